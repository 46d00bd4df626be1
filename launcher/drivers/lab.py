"""`dlaunch lab` without argv: fp32, the plan's mixed precision, and mixed precision + compile,
back to back on the same seed and the same fixed data slice, and what the differences say.

The three runs share everything but precision and compile (the base LaunchSpec: strategy,
micro-batch, steps, seed; the dataset is `steps x global batch` samples in a seeded order), so
the speed-ups isolate the two levers the training-performance literature says to try first:

- precision: a bf16/fp16 step does the same arithmetic at 2x or more the peak rate; a gain under
  20% means arithmetic is not what the step waits for (data loading, communication or launch
  overhead is: look at the verdict and the data-wait share);
- compile: fuses elementwise kernels and removes Python overhead; a small gain means the
  kernels are already big or fused (matmul-bound), or the step is bound elsewhere.

Never imports cli or runtime.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from launcher.drivers.launch import RunOne
from launcher.errors import UsageError
from launcher.files import atomic_write_json, storage
from launcher.hardware.detect import cpu_info, detect_topology
from launcher.results.table import format_table
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.specs import GIB

PRECISION_GAIN_FLOOR = 0.20  # below this precision speed-up: not arithmetic-bound
COMPILE_GAIN_FLOOR = 0.10  # below this compile speed-up: kernels already fused
# throughput varies 10-30% run to run on a machine shared with other work: say so near the floor
NOISE = 0.30
# a measured step this many times its run's median: most likely compile (a recompile) after the warm-up
WARMING_SPREAD = 3.0


@dataclass(frozen=True, kw_only=True)
class Precisions:
    """What this device can compute in, and the mixed precision the lab measures."""

    mixed: str  # bf16 | fp16: the second row
    usable: tuple[str, ...]  # precisions with hardware support here
    note: str  # one line for the user
    # the third row: compile of the precision the plan trains in (fp32 where the plan keeps fp32,
    # on a CPU without a bf16 unit), so its gain is the one a user of the plan would get
    compiled: str = ""

    @property
    def compile_precision(self) -> str:
        """The precision the compiled row runs in."""
        return self.compiled or self.mixed


def _precisions(mixed: str, usable: tuple[str, ...], note: str, plan_precision: str | None) -> Precisions:
    """The compiled row in the plan's precision when it is one the lab runs, else in the mixed."""
    compiled = plan_precision if plan_precision in ("fp32", mixed) else mixed
    return Precisions(mixed=mixed, usable=usable, compiled=compiled,
                      note=note + ("" if compiled == mixed else f"; the compiled row runs the plan's {compiled}"))


def cpu_precisions(flags: frozenset[str] | set[str], plan_precision: str | None = None) -> Precisions:
    """On CPU: bf16 when the CPU has a bf16 unit (AMX or AVX-512 BF16), else bf16 emulated (fp16
    autocast runs on any CPU, but without AVX-512 FP16 / AMX-FP16 it is converted in software;
    bf16 is the precision the planner uses on CPUs)."""
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    fp16_units = [f for f in ("amx_fp16", "avx512_fp16") if f in flags]
    usable = ("fp32", *(("bf16",) if units else ()), *(("fp16",) if fp16_units else ()))
    mixed = plan_precision if plan_precision in ("bf16", "fp16") else "bf16"
    if units:
        note = (f"this CPU computes in {', '.join(usable)} ({', '.join(units + fp16_units)}); "
                f"mixed precision here is {mixed}")
    else:
        note = ("this CPU has no bf16 unit (no amx_bf16 / avx512_bf16): the plan keeps fp32, and "
                "the bf16 row shows what emulated bf16 costs")
    return _precisions(mixed, usable, note, plan_precision)


def cuda_precisions(capability: tuple[int, int] | None, plan_precision: str | None = None) -> Precisions:
    """On CUDA: bf16 from compute capability 8.0 (Ampere), fp16 + GradScaler before it."""
    has_bf16 = capability is not None and capability >= (8, 0)
    usable = ("fp32", "tf32", "bf16", "fp16") if has_bf16 else ("fp32", "fp16")
    mixed = plan_precision if plan_precision in ("bf16", "fp16") else ("bf16" if has_bf16 else "fp16")
    cc = f"compute capability {capability[0]}.{capability[1]}" if capability else "unknown capability"
    note = f"this GPU ({cc}) computes in {', '.join(usable)}; mixed precision here is {mixed}"
    return _precisions(mixed, usable, note + ("" if mixed == "bf16" else " with a GradScaler"), plan_precision)


def detect_precisions(device: str, plan_precision: str | None = None) -> Precisions:
    """Precisions of this machine (CPU flags or the first GPU's compute capability)."""
    if device == "cpu":
        return cpu_precisions(cpu_info().flags, plan_precision)
    return cuda_precisions(detect_topology().accelerator.compute_capability, plan_precision)


@dataclass(frozen=True, kw_only=True)
class LabRow:
    """One of the three runs."""

    name: str
    precision: str
    compile: bool
    result: RunResult


@dataclass(frozen=True, kw_only=True)
class LabResult:
    """The three runs, the two speed-ups and the reading."""

    lab_dir: str
    precisions: Precisions
    rows: tuple[LabRow, ...]
    precision_speedup: float | None = None  # mixed / fp32 throughput
    compile_speedup: float | None = None  # mixed + compile / mixed
    reading: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """Every run finished cleanly."""
        return len(self.rows) == 3 and all(r.result.status == "ok" for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the rows carry their full RunResult."""
        return {"lab_dir": self.lab_dir, "precisions": dataclasses.asdict(self.precisions),
                "rows": [{"name": r.name, "precision": r.precision, "compile": r.compile,
                          "result": r.result.to_dict()} for r in self.rows],
                "precision_speedup": self.precision_speedup, "compile_speedup": self.compile_speedup,
                "reading": list(self.reading), "ok": self.ok}


def lab_specs(base: LaunchSpec, mixed: str, compiled: str | None = None) -> list[tuple[str, LaunchSpec]]:
    """The three runs' specs: same everything, each in its own sub-directory of the lab dir.
    The third compiles `compiled` (default: the mixed precision)."""
    if base.fsdp_unit == "linear":  # said before anything starts: the third run compiles, which linear units cannot
        raise UsageError("`dlaunch lab`'s third run compiles, which `fsdp_unit` linear does not (FSDP's hooks would "
                         "sit inside each compiled block): use `fsdp_unit` block, or `dlaunch run` for linear units")
    out = []
    third = compiled or mixed
    for name, precision, on in (("fp32", "fp32", False), (mixed, mixed, False), (f"{third}+compile", third, True)):
        slug = name.replace("+", "-")
        out.append((name, dataclasses.replace(base, run_id=f"{base.run_id}-{slug}", precision=precision, compile=on,
                                              run_dir=str(Path(base.run_dir) / slug))))
    return out


def _speedup(new: RunResult, old: RunResult) -> float | None:
    if new.status != "ok" or old.status != "ok" or not old.samples_per_s:
        return None
    return new.samples_per_s / old.samples_per_s


def reading(rows: tuple[LabRow, ...], precision_gain: float | None, compile_gain: float | None) -> tuple[str, ...]:
    """What the speed-ups say, in the literature's terms."""
    out = []
    base = rows[0].result
    if precision_gain is not None:
        if precision_gain < 1:
            out.append(f"mixed precision was {100 * (1 - precision_gain):.0f}% slower than fp32: "
                       "the casts cost more than the faster math saves (small matmuls, or no fast "
                       "low-precision path on this device); the step is not bound by arithmetic")
        elif precision_gain - 1 < PRECISION_GAIN_FLOOR:
            out.append(f"precision gained {100 * (precision_gain - 1):+.0f}% (< {100 * PRECISION_GAIN_FLOOR:.0f}%): "
                       "the step is not bound by arithmetic; look at data loading (batch wait "
                       f"{100 * base.data_wait_share:.0f}% of the step) and communication before faster math")
        else:
            out.append(f"precision gained {100 * (precision_gain - 1):+.0f}%: the step is "
                       "arithmetic-bound; keep mixed precision")
    if compile_gain is not None:
        if compile_gain - 1 < COMPILE_GAIN_FLOOR:
            out.append(f"compile gained {100 * (compile_gain - 1):+.0f}% (< "
                       f"{100 * COMPILE_GAIN_FLOOR:.0f}%): the kernels are already large or fused "
                       "(matmul-bound) or the step waits elsewhere; compile is not worth its start-up")
        else:
            out.append(f"compile gained {100 * (compile_gain - 1):+.0f}%: fusing kernels pays; keep --compile")
        spread = max((r.step_time_max_s / r.step_time_median_s for r in rows[-1].result.ranks if r.step_time_median_s),
                     default=0.0)
        if spread > WARMING_SPREAD:
            out.append(f"the compiled run's slowest measured step took {spread:.1f}x its median (most likely a "
                       "compile after the warm-up): its gain may be understated; rerun with more --warmup-steps")
    if any(g is not None and abs(g - 1) < NOISE for g in (precision_gain, compile_gain)):
        out.append(f"runs on a busy machine vary 10-30% in throughput: repeat the lab before "
                   f"acting on a difference under {100 * NOISE:.0f}%")
    row = rows[1] if len(rows) > 1 else rows[0]  # the mixed-precision run, else fp32's
    if verdict := row.result.verdict:
        out.append(f"bottleneck ({row.name} run): {verdict['name']}: {verdict.get('evidence', '')}")
    return tuple(out)


def run_lab(base: LaunchSpec, precisions: Precisions, *, run: RunOne, progress: IO[str] = sys.stderr) -> LabResult:
    """Run the three configurations one after another; stop at the first failed run. Each run's
    own summary and rank output (`run(spec, out=...)`, the driver's `Runner`) go to a buffer,
    printed only when that run fails."""
    rows: list[LabRow] = []
    specs = lab_specs(base, precisions.mixed, precisions.compile_precision)
    for i, (name, spec) in enumerate(specs, 1):
        with storage(Path(spec.run_dir)):
            Path(spec.run_dir).mkdir(mode=0o750, parents=True, exist_ok=True)
        progress.write(f"dlaunch lab: [{i}/{len(specs)}] {name} ...\n")
        progress.flush()
        t0, buf = time.monotonic(), io.StringIO()
        result = run(spec, out=buf)
        progress.write(f"dlaunch lab: [{i}/{len(specs)}] {name} {result.status} in {time.monotonic() - t0:.0f} s\n")
        rows.append(LabRow(name=name, precision=spec.precision, compile=spec.compile, result=result))
        if result.status != "ok":
            progress.write(buf.getvalue())
            break
    frozen = tuple(rows)
    p_gain = _speedup(frozen[1].result, frozen[0].result) if len(frozen) > 1 else None
    c_gain = _speedup(frozen[2].result, frozen[_eager_twin(frozen)].result) if len(frozen) > 2 else None
    lab = LabResult(lab_dir=base.run_dir, precisions=precisions, rows=frozen, precision_speedup=p_gain,
                    compile_speedup=c_gain, reading=reading(frozen, p_gain, c_gain))
    atomic_write_json(RunPaths(root=base.run_dir).lab, lab.to_dict())
    return lab


def _eager_twin(rows: tuple[LabRow, ...]) -> int:
    """The row the compiled (third) row is measured against: the eager run of its precision."""
    return 0 if rows[2].precision == rows[0].precision else 1


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def format_lab(lab: LabResult) -> str:
    """The three-row table, the speed-ups and the reading."""
    units = lab.rows[0].result.sample_units if lab.rows else "samples"
    header = ["run", "status", "samples/s", *([f"{units}/s"] if units != "samples" else []),
              "step med", "peak mem", "speed-up", "loss", "compile"]
    rows = []
    for i, row in enumerate(lab.rows):
        r = row.result
        # each row against the eager row before it of the same precision (or fp32's)
        prev = lab.rows[_eager_twin(lab.rows) if i == 2 else 0].result if i else None
        gain = "1.00x" if i == 0 else (f"{s:.2f}x" if prev and (s := _speedup(r, prev)) else "-")
        r0 = r.ranks[0] if r.ranks else None
        comp = "-"
        if row.compile and r0 is not None and r0.compiled_graphs is not None:
            comp = ("eager fallback" if r0.compile_fallback else
                    f"{r0.compiled_graphs} graph(s), {r0.graph_breaks} break(s)")
        peak = max((x.peak_mem_bytes for x in r.ranks if x.peak_mem_bytes), default=None)
        rows.append([row.name, r.status, _fmt_rate(r.samples_per_s),
                     *([_fmt_rate(r.units_per_s)] if units != "samples" else []), f"{r.step_time_median_s:.3f}s",
                     "-" if peak is None else f"{peak / GIB:.2f} GiB", gain,
                     "-" if r0 is None or r0.final_loss is None else f"{r0.final_loss:.4f}", comp])
    first = lab.rows[0].result if lab.rows else None
    head = "lab" if first is None else (f"lab: {first.world_size} rank(s), {first.device}, {first.strategy}, same "
                                        "seed and data; speed-up: mixed precision against fp32, compile against "
                                        "the eager run of its precision")
    out = [head, f"precisions: {lab.precisions.note}", format_table(header, rows)]
    if first is not None and first.device == "cpu":
        out.append("peak mem on CPU is each rank's peak resident set (ru_maxrss), not tensor bytes")
    out.extend(f"reading: {line}" for line in lab.reading)
    out.extend(f"FAILED ({row.name}): {f}" for row in lab.rows for f in row.result.failures)
    out.append(f"runs: {lab.lab_dir}/{{{','.join(r.name.replace('+', '-') for r in lab.rows)}}}; "
               f"{RunPaths(root=lab.lab_dir).lab.name} beside them")
    return "\n".join(out)
