"""`dlaunch report`: a sweep, run or tune directory in, HTML / Markdown / JSON / PNG files out.

Never imports cli, backends, jobs or runtime; matplotlib loads only when a figure is drawn
(`plots`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.files import atomic_write_json, atomic_write_text, storage
from launcher.hardware.types import Topology
from launcher.report.html import page
from launcher.report.plots import build_plots
from launcher.report.scaling import build_report
from launcher.report.tune import markdown_lines, terminal_lines
from launcher.report.types import HTML_PAGE, ScalingReport, dash
from launcher.results.prediction import prediction_line
from launcher.rundir import REPORT_SUBDIR

log = logging.getLogger(__name__)

FORMATS = ("html", "md", "json", "png")
# every file of a report, whatever the umask: readable by all (it is meant to be shared), writable by its owner
REPORT_FILE_MODE = 0o644


def parse_formats(text: str | Iterable[str]) -> set[str]:
    """`"html,md"` -> {"html", "md"}; one-line UsageError for an unknown or empty format."""
    items = [item.strip().lower() for item in (text.split(",") if isinstance(text, str) else text)]
    if (bad := next((item for item in items if item not in FORMATS), None)) is not None:
        raise UsageError(f"--format {bad!r} is not one of {','.join(FORMATS)} "
                         f"(comma-separated, e.g. --format html,png)")
    if not items:
        raise UsageError(f"--format needs at least one of {','.join(FORMATS)}")
    return set(items)


def markdown(report: ScalingReport, plots: Iterable[str] = (), *, out_dir: Path | None = None) -> str:
    """A short Markdown summary: the tune's table (of a tune dir), scaling table, verdicts,
    stragglers, notes. `out_dir`: where the file goes, for relative links."""
    units = report.sample_units
    lines = [f"# dlaunch report: {Path(report.source).name}", "", f"{report.headline()}, source `{report.source}`", ""]
    if report.tune is not None:
        lines += markdown_lines(report.tune, link_from=out_dir)
    if report.kind not in ("run", "tune"):
        extra = units != "samples"
        lines += [f"| ranks | ok/runs | samples/s | {units + '/s | ' if extra else ''}step (s) | "
                  "efficiency | predicted step (s, 80% interval) | predicted eff. |",
                  "|---:|---:|---:|" + ("---:|" if extra else "") + "---:|---:|---:|---:|"]
        for r in report.rows:
            lo_hi = r.predicted_interval_s
            span = f" ({lo_hi[0]:.3g}-{lo_hi[1]:.3g})" if lo_hi else ""
            lines.append(f"| {r.world_size} | {r.repeats_ok}/{r.repeats} | {dash(r.samples_per_s, '{:,.1f}')} | "
                         + (f"{dash(r.units_per_s, '{:,.0f}')} | " if extra else "") +
                         f"{dash(r.step_time_s, '{:.4f}')} | {dash(r.efficiency and 100 * r.efficiency, '{:.0f}%')} | "
                         f"{dash(r.predicted_step_time_s, '{:.3g}')}{span} | "
                         f"{dash(r.predicted_efficiency and 100 * r.predicted_efficiency, '{:.0f}%')} |")
        lines.append("")
    lines += ["| point | status | compute | exposed comm | batch wait | other | busbw GB/s | verdict |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for p in report.points:
        s = p.shares
        lines.append(f"| {p.name} | {p.status} | {dash(s.get('compute'), '{:.0%}')} | "
                     f"{dash(s.get('exposed_comm'), '{:.0%}')} | {dash(s.get('data_wait'), '{:.0%}')} | "
                     f"{dash(s.get('other'), '{:.0%}')} | {dash(p.busbw_gb_s, '{:.3g}')} | "
                     f"{p.verdict.get('name', '-') if p.verdict else (p.error or '-')} |")
    lines.append("")
    for p in report.points:
        if p.verdict:
            lines.append(f"- **{p.name}: {p.verdict['name']}**: {p.verdict.get('evidence', '')}")
        lines += [f"- {_straggler_line(p.name, s)}" for s in p.stragglers]
        if p.run_id:
            lines.append(f"- {p.name}: {prediction_line(p.prediction)}")
    if report.warnings:
        lines += ["", "## Warnings", *(f"- WARNING: {w}" for w in report.warnings)]
    if notes := report.note_lines():
        lines += ["", "## Notes", *(f"- {n}" for n in notes)]
    if figs := list(plots):
        lines += ["", "## Figures", *(f"![{k}]({k}.png)" for k in figs)]
    return "\n".join(lines) + "\n"


def write_report(path: str | Path, formats: Iterable[str] = FORMATS, *,
                 out_dir: str | Path | None = None, topology: Topology | None = None,
                 default_topology: Topology | None = None, with_prediction: bool = True) -> list[Path]:
    """`render_report` without the numbers: the files written into `out_dir` (default PATH/report/)."""
    return render_report(path, formats, out_dir=out_dir, topology=topology,
                         default_topology=default_topology, with_prediction=with_prediction)[0]


def render_report(path: str | Path, formats: Iterable[str] = FORMATS, *, out_dir: str | Path | None = None,
                  topology: Topology | None = None, default_topology: Topology | None = None,
                  with_prediction: bool = True) -> tuple[list[Path], ScalingReport]:
    """Build the report's numbers, write the files asked for in `formats`, and return both.
    DlaunchError (one line) for a directory without runs; unreadable rank files are named in the
    report, not fatal."""
    fmts = parse_formats(formats if isinstance(formats, str) else list(formats))
    t0 = time.perf_counter()
    report = build_report(Path(path), topology=topology, default_topology=default_topology,
                          with_prediction=with_prediction)
    t_build = time.perf_counter() - t0
    out = Path(out_dir) if out_dir is not None else Path(path) / REPORT_SUBDIR
    with storage(out):
        out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    plots = build_plots(report) if fmts & {"html", "png"} else []
    if "png" in fmts:
        for p in plots:
            target = out / f"{p.key}.png"
            tmp = target.with_suffix(".png.tmp")
            tmp.write_bytes(p.png)
            tmp.replace(target)
            written.append(target)
    if "html" in fmts:
        atomic_write_text(out / HTML_PAGE, page(report, plots, out_dir=out))
        written.append(out / HTML_PAGE)
    if "json" in fmts:
        atomic_write_json(out / "report.json", report.to_dict())
        written.append(out / "report.json")
    if "md" in fmts:
        atomic_write_text(out / "report.md",
                          markdown(report, [p.key for p in plots] if "png" in fmts else [], out_dir=out))
        written.append(out / "report.md")
    for path_ in written:
        os.chmod(path_, REPORT_FILE_MODE)
    log.debug("report of %s: numbers %.2f s, total %.2f s", path, t_build, time.perf_counter() - t0)
    return written, report


def summary_lines(report: ScalingReport) -> list[str]:
    """What `dlaunch report` prints to the terminal."""
    lines = terminal_lines(report.tune) if report.tune is not None else []
    if report.kind not in ("run", "tune"):
        lines += [f"  {r.world_size:>5} rank(s): {dash(r.samples_per_s, '{:,.1f}')} samples/s, efficiency "
                  f"{dash(r.efficiency and 100 * r.efficiency, '{:.0f}%')} ({r.repeats_ok}/{r.repeats} ok)"
                  for r in report.rows]
    for p in report.points:
        if p.verdict:
            lines.append(f"  {p.name}: {p.verdict['name']} ({p.verdict.get('evidence', '')})")
        elif p.status != "ok" and report.tune is None:  # a tune's outcome lines name it
            lines.append(f"  {p.name}: {p.status.upper()}" + (f": {p.error}" if p.error else ""))
        lines += [f"  {_straggler_line(p.name, s)}" for s in p.stragglers]
        if p.run_id:
            lines.append(f"  {p.name}: {prediction_line(p.prediction)}")
        lines += [f"  note: {p.name}: {n}" for n in p.unreadable]
    lines += [f"  WARNING: {w}" for w in report.warnings]
    if report.prediction_note:
        lines.append(f"  note: {report.prediction_note}")
    return lines


def _straggler_line(point: str, s: Mapping[str, Any]) -> str:
    """One straggler of a point, as the terminal and report.md say it."""
    return (f"STRAGGLER in {point}: rank {s['rank']} on {s['host']} (local rank {s['local_rank']}), "
            f"median step {s['median_s']:.4f} s; {s['signal']}")
