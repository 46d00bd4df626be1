"""The workload contract and the loader of a workload file.

A workload is one Python file that declares the model, the data and the loss; the harness owns
the loop, so every plan (wrapping, precision, compile, accumulation) is applied the same way:

    DEFAULTS = {"size": "tiny"}                  # optional: options settable with `-- --size small`
    def build_model(cfg) -> nn.Module            # must also work under `with torch.device("meta")`
    def make_dataset(cfg, num_samples) -> Dataset   # map-style (item i deterministic) or an
                                                 # IterableDataset (a deterministic stream;
                                                 # see launcher/runtime/stream.py)
    def loss_fn(model, batch) -> Tensor
    def blocks(model) -> list[nn.Module]         # optional: units for FSDP wrapping / checkpointing
    SAMPLE_UNITS = "tokens"                      # optional: what throughput counts
    KERNELS = {"attention": "fa2"}               # optional: the kernels it runs, for the plan's
                                                 # price (attention, loss, norm; plan.kernels)
    def units_per_sample(cfg) -> int             # optional: e.g. the sequence length
    def make_optimizer(cfg, model) -> Optimizer  # optional: default AdamW(lr=1e-3)
    def make_scheduler(cfg, optimizer) -> LRScheduler | None  # optional: default none
    def evaluate(model, cfg) -> dict[str, float] # optional: run every --eval-every steps
    def tp_plan(model, tp) -> dict[str, ParallelStyle] | None
                                                 # optional: tensor parallelism of degree tp
                                                 # (DTensor styles by module name, as
                                                 # parallelize_module takes them); None: tp
                                                 # does not divide the model (its heads)

A file that defines none of these names but has an `if __name__ == "__main__":` block is a
plain torchrun script: dlaunch launches it unchanged.

The workload's folder is put first on `sys.path` when it is loaded, as `python file.py` and
`torchrun file.py` would have it, so it can import its neighbours (`from model import GPT`) in
the launcher (profile), in every rank and in the DataLoader's workers (they inherit it).

`inspect_file` reads a file without executing it (the launcher must not import torch, which a
workload does); `load_workload` imports it (inside a rank, or for profiling), and
`workload_prints_held` keeps what workload code prints in dlaunch's own process off its output.

Imports only `launcher.errors`, and torch never at module level: the CLI reads workload files
without it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import io
import itertools
import logging
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from launcher.errors import WorkloadError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

REQUIRED = ("build_model", "make_dataset", "loss_fn")
DEFAULT_LR = 1e-3  # the default optimizer's (AdamW) learning rate


def no_tp_plan(tp: int, what: str) -> str:
    """The one line for tensor parallelism asked of `what` (e.g. "workload gpt.py"), which has
    no `tp_plan`: checked from the file, by the planner and by the loaded workload alike."""
    return (f"--tp {tp}: {what} defines no tp_plan(model, tp), and tensor parallelism needs one to "
            "know which modules to split (see docs/workloads.md); drop --tp or add tp_plan")


@dataclass(frozen=True, kw_only=True)
class FileKind:
    """What a file is, decided from its syntax tree alone."""

    path: Path
    is_script: bool
    has_tp_plan: bool = False  # defines `tp_plan` at top level: may be given tensor parallelism

    def require_tp_plan(self, tp: int | None) -> None:
        """WorkloadError unless tensor parallelism of degree `tp` (None or 1: none) can apply, from the file alone."""
        if tp not in (None, 1) and not self.has_tp_plan:
            raise WorkloadError(no_tp_plan(tp, "a plain script" if self.is_script else f"workload {self.path.name}"))


def _resolve(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise WorkloadError(f"workload file {str(path)!r} does not exist; "
                            "give the path of a .py file (see workloads/ for examples)")
    if not p.is_file() or p.suffix != ".py":
        raise WorkloadError(f"workload {str(path)!r} is not a .py file; "
                            "give the path of a Python file such as workloads/gpt.py")
    return p.resolve()


def _has_main_guard(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and "__name__" in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
               and "__main__" in {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
               for node in tree.body)


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def inspect_file(path: str | Path, *, force_script: bool = False) -> FileKind:
    """Classify a file as a workload or a plain script without running it; WorkloadError for a
    missing file, a syntax error, a partial contract, or a file that is neither."""
    p = _resolve(path)
    try:
        tree = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
    except SyntaxError as e:
        raise WorkloadError(f"workload {str(path)!r} has a syntax error at line {e.lineno}: "
                            f"{e.msg}; fix the file and run again") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read workload {str(path)!r}: {e}") from None
    if force_script:
        return FileKind(path=p, is_script=True)
    names = _top_level_names(tree)
    present = [n for n in REQUIRED if n in names]
    if present and len(present) < len(REQUIRED):
        missing = ", ".join(n for n in REQUIRED if n not in names)
        raise WorkloadError(f"workload {str(path)!r} defines {', '.join(present)} but not "
                            f"{missing}; a workload needs all of {', '.join(REQUIRED)} (a plain script: --script)")
    if present:
        return FileKind(path=p, is_script=False, has_tp_plan="tp_plan" in names)
    if _has_main_guard(tree):
        return FileKind(path=p, is_script=True)
    raise WorkloadError(f"{str(path)!r} is neither a workload (it defines none of {', '.join(REQUIRED)}) nor a "
                        "script (no `if __name__ == \"__main__\":` block; --script runs it as one); see "
                        "workloads/mlp.py for the contract")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A loaded workload module, with its options resolved."""

    path: Path
    module: types.ModuleType
    cfg: types.SimpleNamespace
    sample_units: str = "samples"
    units_per_sample: int = 1
    defaults: Mapping[str, Any] = field(default_factory=dict)
    kernels: Mapping[str, str] = field(default_factory=dict)  # KERNELS: role -> kernel, unchecked

    def build_model(self) -> torch.nn.Module:
        """Build the model (under whatever device context the caller set)."""
        return self._call("build_model", self.cfg)

    def make_dataset(self, num_samples: int) -> torch.utils.data.Dataset[Any]:
        """The map-style dataset the harness wraps in a DataLoader."""
        return self._call("make_dataset", self.cfg, num_samples)

    def first_samples(self, n: int) -> list[Any]:
        """The first `n` samples of `make_dataset(n)`, map-style or a stream alike (what the
        planner's probes collate); WorkloadError when it holds fewer."""
        from torch.utils.data import IterableDataset  # deferred: the launcher reads workloads without torch

        dataset = self.make_dataset(n)
        if isinstance(dataset, IterableDataset):
            samples = list(itertools.islice(iter(dataset), n))
        else:
            samples = [dataset[i] for i in range(min(n, len(dataset)))]  # type: ignore[arg-type]
        if len(samples) < n:
            raise WorkloadError(f"workload {self.path.name}: make_dataset({n}) gave {len(samples)} "
                                "sample(s); it must hold at least the number asked for")
        return samples

    def loss_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (hot path: no wrapping of exceptions here)."""
        return self.module.loss_fn(model, batch)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated units for FSDP wrapping and checkpointing; [] when not declared."""
        fn: Callable[[Any], Sequence[Any]] | None = getattr(self.module, "blocks", None)
        return list(fn(model)) if fn is not None else []

    def make_optimizer(self, model: torch.nn.Module, *, fused: bool = False) -> torch.optim.Optimizer:
        """The workload's `make_optimizer(cfg, model)`, else AdamW(lr=1e-3) over the trainable
        parameters (`fused`: the fused kernel, CUDA only)."""
        import torch  # deferred: the launcher reads workloads without torch

        if not hasattr(self.module, "make_optimizer"):
            return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=DEFAULT_LR, fused=fused)
        optimizer = self._call("make_optimizer", self.cfg, model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise self._returned("make_optimizer", optimizer, "a torch.optim.Optimizer")
        return optimizer

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The workload's `make_scheduler(cfg, optimizer)`, stepped once per optimizer step; None if not declared."""
        if not hasattr(self.module, "make_scheduler"):
            return None
        scheduler = self._call("make_scheduler", self.cfg, optimizer)
        if scheduler is not None and not (callable(getattr(scheduler, "step", None))
                                          and callable(getattr(scheduler, "state_dict", None))):
            raise self._returned("make_scheduler", scheduler, "a torch.optim.lr_scheduler.LRScheduler or None")
        return cast("torch.optim.lr_scheduler.LRScheduler | None", scheduler)

    @property
    def has_tp_plan(self) -> bool:
        """The workload declares `tp_plan(model, tp)`: it can be given tensor parallelism."""
        return callable(getattr(self.module, "tp_plan", None))

    def tp_plan(self, model: torch.nn.Module, tp: int) -> dict[str, Any] | None:
        """The workload's `tp_plan(model, tp)`: {module name or pattern: ParallelStyle}, or None
        where `tp` does not divide the model. WorkloadError without the hook or for another
        return type. The hook may also adapt the model to its shard (e.g. local head counts)."""
        if not self.has_tp_plan:
            raise WorkloadError(no_tp_plan(tp, f"workload {self.path.name}"))
        plan = self._call("tp_plan", model, tp)
        if plan is not None and not (isinstance(plan, Mapping) and all(isinstance(k, str) for k in plan)):
            raise self._returned("tp_plan", plan, "a dict of module name -> ParallelStyle, or None")
        return None if plan is None else dict(plan)

    @property
    def has_evaluate(self) -> bool:
        """The workload declares `evaluate(model, cfg)`."""
        return callable(getattr(self.module, "evaluate", None))

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """The workload's `evaluate(model, cfg)` as {name: float}; WorkloadError otherwise."""
        result = self._call("evaluate", model, self.cfg)
        try:
            return {str(k): float(v) for k, v in dict(result).items()}
        except (TypeError, ValueError):
            raise self._returned("evaluate", result, "a dict of name -> number") from None

    def _returned(self, name: str, value: Any, what: str) -> WorkloadError:
        """The error for hook `name` returning `value` where it must return `what`."""
        return WorkloadError(f"workload {self.path.name}: {name}() returned {type(value).__name__}; "
                             f"it must return {what}")

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.module, name)(*args)
        except WorkloadError:
            raise
        except Exception as e:
            raise WorkloadError(f"workload {self.path.name}: {name}() raised {type(e).__name__}: {e}") from e


def parse_options(defaults: Mapping[str, Any], args: Sequence[str], *, source: str) -> dict[str, Any]:
    """Apply `--key value` / `--key=value` / `--flag` pairs to a workload's DEFAULTS. Values take
    the type of the default (bool accepts true/false/1/0); unknown keys are errors."""
    cfg = dict(defaults)
    options = ", ".join("--" + k for k in defaults) or "none"
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--") or tok == "--":
            raise WorkloadError(f"{source}: expected --option, got {tok!r}; options: {options}")
        key, _, value = tok[2:].partition("=")
        key = key.replace("-", "_")
        if key not in defaults:
            raise WorkloadError(f"{source}: unknown option --{key}; options: {options}")
        default = defaults[key]
        if not value and "=" not in tok:
            if isinstance(default, bool) and (i + 1 >= len(args) or args[i + 1].startswith("--")):
                value = "true"
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise WorkloadError(f"{source}: --{key} needs a value")
        cfg[key] = _coerce(default, value, key=key, source=source)
        i += 1
    return cfg


def _coerce(default: Any, value: str, *, key: str, source: str) -> Any:
    try:
        if isinstance(default, bool):
            low = value.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return low in ("true", "1", "yes")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise WorkloadError(f"{source}: --{key} expects a {type(default).__name__}, got {value!r}") from None
    return value


def load_workload(path: str | Path, args: Sequence[str] = ()) -> Workload:
    """Import a workload file and resolve its options; every failure is one WorkloadError line."""
    kind = inspect_file(path)
    if kind.is_script:
        raise WorkloadError(f"{str(path)!r} is a plain script, not a workload: it defines none of "
                            f"{', '.join(REQUIRED)}")
    p = kind.path
    # its neighbours importable, as `python file.py` has it; first, so a sibling model.py wins
    # over an installed `model` as it would there
    if str(p.parent) not in sys.path:
        sys.path.insert(0, str(p.parent))
    mod_name = f"dlaunch_workload_{p.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"cannot import workload {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    # registered before exec so dataclasses and pickling (DataLoader workers) can find it
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise WorkloadError(f"workload {str(path)!r} raised on import: {type(e).__name__}: {e}") from e
    defaults = dict(getattr(module, "DEFAULTS", {}) or {})
    cfg = types.SimpleNamespace(**parse_options(defaults, args, source=f"workload {p.name}"))
    units_fn = getattr(module, "units_per_sample", None)
    try:
        units = int(units_fn(cfg)) if callable(units_fn) else 1
    except WorkloadError:
        raise
    except Exception as e:  # the workload's own check of its options (an unknown --size)
        raise WorkloadError(f"workload {p.name}: {type(e).__name__}: {e}") from e
    if units < 1:
        raise WorkloadError(f"workload {p.name}: units_per_sample() returned {units}; must be >= 1")
    # the names are the plan's to check (plan.kernels: this module imports no spec)
    kernels = getattr(module, "KERNELS", None) or {}
    if not (isinstance(kernels, Mapping) and all(isinstance(v, str) for v in kernels.values())):
        raise WorkloadError(f"workload {p.name}: KERNELS must be a dict of role -> kernel name, "
                            "e.g. {\"attention\": \"fa2\", \"loss\": \"fused\"}")
    return Workload(path=p, module=module, cfg=cfg, defaults=defaults, kernels=dict(kernels),
                    sample_units=str(getattr(module, "SAMPLE_UNITS", "samples")), units_per_sample=units)


def optimizer_kwargs(cls: type, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings (a group's, an optimizer's defaults) `cls`'s constructor takes: all under **kwargs;
    AdamW's `decoupled_weight_decay` is a default, not an argument."""
    params = inspect.signature(cls).parameters  # the constructor's, without self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(settings)
    return {k: v for k, v in settings.items() if k in params}


def batch_norms(model: Any) -> list[Any]:
    """The batch-norm modules of a workload's model (BatchNorm*, SyncBatchNorm, lazy variants): FSDP
    under low precision makes each an fp32 unit of its own (runtime.wrap), as the planner prices them."""
    from torch.nn.modules.batchnorm import _BatchNorm  # deferred: the CLI reads workloads without torch

    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def linear_layers(block: Any) -> list[Any]:
    """A block's nn.Linear modules (float8's too), FSDP units of their own under `fsdp_unit` linear (runtime.wrap),
    but those in a module list or dict: an MoE's experts, which each rank calls only for the tokens routed to
    it, stay in the block's unit (a unit per expert would all-gather on some ranks and not others)."""
    import torch  # deferred, as above

    def walk(module: Any) -> list[Any]:
        return [found for child in module.children() if not isinstance(child, torch.nn.ModuleList | torch.nn.ModuleDict)
                for found in ([child] if isinstance(child, torch.nn.Linear) else walk(child))]

    return walk(block)


@contextlib.contextmanager
def workload_prints_held(what: str) -> Iterator[None]:
    """Run workload code in dlaunch's own process (the planner's probes) with its prints held and
    logged at debug level: dlaunch's stdout carries only its results, which scripts read."""
    held = io.StringIO()
    with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
        try:
            yield
        finally:
            if held.tell():
                log.debug("the workload printed during %s (held): %s", what, held.getvalue()[-2000:])
