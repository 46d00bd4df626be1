"""A run's knobs, each declared once: `knob()` puts its flag, help, unit and check on the field of
the frozen dataclass that holds it (`launcher.runspec.RunSettings`); `Check` says what a number must be.

Everything else derives from those fields (`knobs_of`): the CLI's option table and typed
options, the plan's fallbacks, LaunchSpec and launch.json, so a knob keeps one name from its flag
to the JSON (`--grad-accum`, `grad_accum`). A check is written once: argparse parses with it (the
message names the flag), the settings validate with it (the message names the field in
backticks, which the CLI turns into the flag); the CLI's other numeric options use it too. Every
number has an upper bound far above any real run (`high`): past it a value is a typo. `migrate`
reads the names launch.json used before. Imports only launcher.errors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from launcher.errors import UsageError

KINDS = ("value", "switch", "toggle")  # --x V | --x | --x/--no-x
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Check:
    """What a number must be: of `kind` (int, or a finite float), above `low` (at it too when
    `inclusive`), at most `high`; `phrase` words it where the bounds alone would not."""

    kind: type = int
    low: float | None = None
    inclusive: bool = True
    high: float | None = None
    phrase: str = ""

    def describe(self) -> str:
        """'an integer >= 1', 'a finite number > 0', ..."""
        if self.phrase:
            return self.phrase
        what = "an integer" if self.kind is int else "a finite number"
        return what if self.low is None else f"{what} {'>=' if self.inclusive else '>'} {self.low:g}"

    def bound(self) -> str:
        """The upper bound as a person reads it ('1,000,000,000', '1e+18'); '' without one."""
        if self.high is None:
            return ""
        if self.high < 1e12 and float(self.high).is_integer():
            return f"{int(self.high):,}"
        return f"{self.high:g}".replace("e+", "e")

    def ok(self, value: Any) -> bool:
        """Whether `value` passes (a bool is no number here)."""
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int else int | float):
            return False
        if not math.isfinite(value) or (self.high is not None and value > self.high):
            return False
        return self.low is None or value > self.low or (self.inclusive and value == self.low)

    def validate(self, name: str, value: Any, *, given: str | None = None) -> None:
        """UsageError naming `name` unless `value` passes; `given` is the text it was parsed
        from, shown as typed (`-1e12`, not `-1e+12`)."""
        if self.ok(value):
            return
        shown = given if given is not None else (
            f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else value)
        # good but for the bound: say the bound, the one thing to fix; a phrase words the whole
        # range itself ('a fraction in (0, 1]')
        if not self.phrase and self.high is not None and dataclasses.replace(self, high=None).ok(value):
            raise UsageError(f"{name} must be at most {self.bound()} (no real run needs more), got {shown}")
        raise UsageError(f"{name} must be {self.describe()}, got {shown}")

    def parser(self, flag: str) -> Callable[[str], Any]:
        """An argparse `type` that converts and checks, naming `flag` when it refuses. An integer
        may be written in scientific notation (`--global-batch 1e6`), as people write counts."""

        def parse(text: str) -> Any:
            try:
                value = self.kind(text)
            except ValueError:
                value = _whole(text) if self.kind is int else None
                if value is None:
                    raise UsageError(f"{flag} must be {self.describe()}, got {text!r}") from None
            self.validate(flag, value, given=text)
            return value

        return parse


def _whole(text: str) -> int | None:
    """The integer `text` writes in float notation ('1e7', '2.0'), or None (not a whole number)."""
    try:
        x = float(text)
    except ValueError:
        return None
    return int(x) if math.isfinite(x) and x.is_integer() else None


def at_least(low: int, high: int) -> Check:
    """An integer from `low` to `high`."""
    return Check(low=low, high=high)


def positive(high: float) -> Check:
    """A finite number > 0, at most `high`."""
    return Check(kind=float, low=0.0, inclusive=False, high=high)


def non_negative(high: float) -> Check:
    """A finite number >= 0, at most `high`."""
    return Check(kind=float, low=0.0, high=high)


def number(high: float) -> Check:
    """A finite number at most `high`: a knob whose range is a rule of its own."""
    return Check(kind=float, high=high)


# the bounds a real run never reaches: 10^9 steps is 30 years at 1 s/step; 10^6 samples per rank per
# forward pass is 100x a tiny model's largest micro-batch on a GPU; 10^9 is 1,000x the largest global batch
MAX_STEPS = 10**9
MAX_SAMPLES = 10**6
MAX_GLOBAL_BATCH = 10**9
MAX_MINUTES = 525_600.0  # a year: a SLURM time limit or a tune budget beyond it is a typo
MINUTES = Check(kind=float, low=0.0, inclusive=False, high=MAX_MINUTES,
                phrase=f"a number of minutes > 0, at most {MAX_MINUTES:,.0f} (a year)")
FRACTION = Check(kind=float, low=0.0, inclusive=False, high=1.0, phrase="a fraction in (0, 1], e.g. 0.8")


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One knob's declaration, carried in its field's metadata (see `knob`)."""

    flag: str
    help: str
    unit: str = ""
    check: Check | None = None
    choices: tuple[str, ...] | None = None
    kind: str = "value"
    # a decision the plan makes: None on the command line leaves it to the plan, and
    # `fallback` is what runs when nothing planned (a plain script, an unplanned SLURM run)
    planned: bool = False
    fallback: Any = None
    # a plain script honours it: dlaunch applies it around the script (placement, timeouts,
    # restarts) or passes it on (the step meter's warm-up); any other knob it would ignore
    script: bool = False


def knob(default: T, flag: str, help: str, *, unit: str = "", check: Check | None = None,
         choices: tuple[str, ...] | None = None, kind: str = "value", planned: bool = False,
         fallback: Any = None, script: bool = False) -> T:
    """A dataclass field holding a knob: its default and its `Knob` declaration."""
    if kind not in KINDS:
        raise ValueError(f"knob {flag}: kind must be one of {KINDS}, got {kind!r}")
    declared = Knob(flag=flag, help=help, unit=unit, check=check, choices=choices, kind=kind,
                    planned=planned, fallback=fallback, script=script)
    return dataclasses.field(default=default, metadata={"knob": declared})


def knobs_of(cls: Any) -> dict[str, Knob]:
    """Field name -> Knob, for every knob field of the dataclass `cls`, in declaration order."""
    return {f.name: f.metadata["knob"] for f in dataclasses.fields(cls) if "knob" in f.metadata}


def validate_knobs(obj: Any) -> None:
    """Each knob of the dataclass instance `obj` that holds a value, against its declaration."""
    for name, k in knobs_of(type(obj)).items():
        if (value := getattr(obj, name)) is None:
            continue
        if k.check is not None:
            k.check.validate(f"`{name}`", value)
        if k.choices is not None and value not in k.choices:
            raise UsageError(f"unknown {name} {value!r}; use one of {', '.join(k.choices)}")


def set_for_script(obj: Any) -> list[str]:
    """The knobs of `obj` a plain script would ignore (`Knob.script` False) that hold neither
    their default nor their fallback: set on purpose, and silently dropped if launched."""
    return [f.name for f in dataclasses.fields(obj) if (k := f.metadata.get("knob")) is not None
            and not k.script and getattr(obj, f.name) not in (f.default, k.fallback)]


# launch.json and plan files written before each knob had one name: old -> new (`migrate`)
RENAMED = {"nproc_per_node": "gpus", "num_nodes": "nodes", "grad_accum_steps": "grad_accum",
           "calibrate_comm": "calibrate"}


def migrate(data: Mapping[str, Any]) -> dict[str, Any]:
    """A launch spec as launch.json held it in any version, in today's names: keys renamed, the nested
    `strategy` and `loader` flattened, checkpointing's old bool as its mode, 0 for 'auto' as None."""
    d = {RENAMED.get(k, k): v for k, v in data.items()}
    strategy = d.get("strategy")
    if isinstance(strategy, Mapping):
        nested = dict(strategy)
        d["strategy"] = nested.pop("kind", "ddp")
        if "activation_checkpointing" in nested:  # written before the checkpointing modes
            nested.setdefault("checkpointing", nested.pop("activation_checkpointing"))
        d.update(nested)
    if isinstance(d.get("checkpointing"), bool):
        d["checkpointing"] = "full" if d["checkpointing"] else "none"
    loader = d.pop("loader", None)
    if isinstance(loader, Mapping) and "num_workers" in loader:
        d.setdefault("num_workers", loader["num_workers"])
    for name in ("log_every", "shard_group_size"):  # 0 meant "auto"; now None does
        if d.get(name) == 0:
            d[name] = None
    return d
