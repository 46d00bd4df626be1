"""The report's figures, drawn with matplotlib's object API on the Agg backend.

matplotlib is imported inside the functions (it costs ~1 s), and no pyplot is used: figures
are plain `Figure` objects, so nothing global is touched and nothing opens a window.
Each figure comes out as PNG bytes and as SVG text for inlining in the HTML page.

Never imports cli, backends, jobs or runtime.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.report.types import GROUP_AXIS, PARTS, Point, Row, ScalingReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = {"compute": "#4C72B0", "exposed_comm": "#DD8452", "data_wait": "#C44E52",
          "other": "#8C8C8C", "measured": "#4C72B0", "predicted": "#55A868", "ideal": "#8C8C8C", "straggler": "#C44E52"}
LABELS = {"compute": "compute", "exposed_comm": "exposed communication",
          "data_wait": "batch wait", "other": "other (optimizer, host)"}
MAX_RANK_PANELS = 6  # per-rank box plots: one panel per world size, the largest ones first


@dataclass(frozen=True)
class Plot:
    """One rendered figure."""

    key: str  # file stem: throughput, efficiency, breakdown, ranks, predicted
    title: str
    caption: str
    png: bytes
    svg: str


def _figure(width: float = 7.0, height: float = 4.0) -> Figure:
    import matplotlib  # deferred: ~0.5 s to load, and `dlaunch report --format md,json` never draws

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # deferred with matplotlib above

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def render(fig: Figure) -> tuple[bytes, str]:
    """(PNG bytes, SVG markup without the XML prologue) of a figure."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    text = svg.getvalue()
    # comments and the RDF metadata block are noise inside an HTML page
    text = re.sub(r"<!--.*?-->|<metadata>.*?</metadata>", "", text[text.find("<svg"):], flags=re.S)
    return png.getvalue(), text


def _ok_rows(report: ScalingReport) -> list[Any]:
    return [r for r in report.rows if r.samples_per_s]


def throughput_figure(report: ScalingReport) -> Figure:
    """Measured throughput against world size, the ideal (linear) line and the prediction."""
    fig = _figure()
    ax = fig.add_subplot()
    rows = _ok_rows(report)
    units = report.sample_units
    use_units = units != "samples"
    xs = [r.world_size for r in rows]
    ys = [(r.units_per_s if use_units else r.samples_per_s) or 0.0 for r in rows]
    scale = [(r.units_per_s / r.samples_per_s) if use_units and r.samples_per_s else 1.0 for r in rows]
    lo = [y - (r.samples_per_s_min or 0) * s for y, r, s in zip(ys, rows, scale)]
    hi = [(r.samples_per_s_max or 0) * s - y for y, r, s in zip(ys, rows, scale)]
    if rows:
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color=COLORS["measured"], capsize=3,
                    label="measured (median, min-max of repeats)")
        ideal = [(r.ideal_samples_per_s or 0) * s for r, s in zip(rows, scale)]
        ax.plot(xs, ideal, "--", color=COLORS["ideal"], label="ideal (linear from the smallest)")
        pred = [(r.predicted_samples_per_s or 0) * s for r, s in zip(rows, scale)]
        if any(r.predicted_samples_per_s for r in rows):
            ax.plot(xs, pred, "s:", color=COLORS["predicted"], label="predicted (cost model)")
        ax.legend(loc="upper left", fontsize=8)
    _world_axis(ax, [r.world_size for r in report.rows])
    ax.set_ylabel(f"{units}/s")
    _value_axis(ax, ys + [y for y in pred if y] if rows else [])
    ax.set_title(f"Throughput ({report.mode} scaling)")
    ax.grid(alpha=0.3)
    return fig


def efficiency_figure(report: ScalingReport) -> Figure:
    """Scaling efficiency against world size, measured and predicted, with 100% marked."""
    fig = _figure()
    ax = fig.add_subplot()
    rows = [r for r in report.rows if r.efficiency is not None]
    xs = [r.world_size for r in rows]
    ax.axhline(100, ls="--", color=COLORS["ideal"], label="ideal (100%)")
    ax.plot(xs, [100 * (r.efficiency or 0) for r in rows], "o-", color=COLORS["measured"], label="measured")
    for x, r in zip(xs, rows):
        ax.annotate(f"{100 * (r.efficiency or 0):.0f}%", (x, 100 * (r.efficiency or 0)),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    pred = [r for r in rows if r.predicted_efficiency is not None]
    if pred:
        ax.plot([r.world_size for r in pred], [100 * (r.predicted_efficiency or 0) for r in pred],
                "s:", color=COLORS["predicted"], label="predicted")
    ax.set_ylim(0, max([110.0] + [100 * (r.efficiency or 0) + 10 for r in rows]))
    _world_axis(ax, [r.world_size for r in report.rows])
    ax.set_ylabel("efficiency (%)")
    formula = "throughput(N) / (N/N0 x throughput(N0))" if report.mode == "weak" else "T(N0) x N0 / (N x T(N))"
    ax.set_title(f"{report.mode.capitalize()} scaling efficiency = {formula}", fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def breakdown_figure(report: ScalingReport) -> Figure:
    """Stacked step time per point: compute, exposed communication, batch wait, other."""
    points = [p for p in report.points if p.breakdown_s]
    fig = _figure(max(7.0, min(12.0, 1.2 + 0.7 * len(points))), 4.0)
    ax = fig.add_subplot()
    labels = [_point_label(p, report) for p in points]
    bottom = [0.0] * len(points)
    for part in PARTS:
        vals = [1000 * p.breakdown_s.get(part, 0.0) for p in points]
        ax.bar(labels, vals, bottom=bottom, color=COLORS[part], label=LABELS[part])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, p in enumerate(points):
        if p.verdict:
            ax.annotate(p.verdict["name"].split()[0], (i, bottom[i]), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=7)
    ax.set_ylabel("ms per optimizer step (mean)")
    ax.set_xlabel({"run": "run", "tune": "trial"}.get(report.kind, "world size (ranks)"))
    ax.set_title("Where the step goes")
    # headroom for the bar labels; the legend sits outside the axes, so it covers no bar
    ax.set_ylim(0, max(bottom + [1e-3]) * 1.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if len(points) > 6:
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    return fig


def ranks_figure(report: ScalingReport) -> Figure:
    """Per-rank (or per-group) step-time box plots, one panel per world size."""
    drawn = [p for p in report.points if p.distribution.get("groups")]
    chosen: dict[int, Point] = {}
    for p in drawn:
        chosen.setdefault(p.world_size, p)
    panels = [chosen[n] for n in sorted(chosen)][-MAX_RANK_PANELS:]
    if report.kind == "tune":  # one world size, one panel per trial
        panels = drawn[:MAX_RANK_PANELS]
    cols = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    widest = max([len(p.distribution["groups"]) for p in panels] + [1])
    width = min(14.0, max(6.0, 2.0 + 0.18 * widest * cols))
    fig = _figure(width, 3.2 * rows)
    if not panels:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no steady steps recorded", ha="center", va="center")
        ax.set_axis_off()
        return fig
    for i, p in enumerate(panels, 1):
        ax = fig.add_subplot(rows, cols, i)
        groups = p.distribution["groups"]
        stats = [{"label": g["label"], "whislo": 1000 * g["p5"], "q1": 1000 * g["p25"], "med": 1000 * g["p50"],
                  "q3": 1000 * g["p75"], "whishi": 1000 * g["p95"], "fliers": []} for g in groups]
        boxes = ax.bxp(stats, showfliers=False, patch_artist=True, widths=0.6)
        for box, g in zip(boxes["boxes"], groups):
            box.set_facecolor(COLORS["straggler"] if g["straggler"] else "#AFC6E9")
        if p.distribution["grouping"] != "rank":
            worst = [1000 * (g["worst_rank_median_s"] or 0) for g in groups]
            ax.plot(range(1, len(groups) + 1), worst, "v", ms=3, color=COLORS["straggler"], label="slowest rank median")
            ax.legend(fontsize=7, loc="upper right")
        step = max(1, len(groups) // 16)
        ax.set_xticks(range(1, len(groups) + 1, step),
                      [g["label"] for g in groups][::step], fontsize=7, rotation=45 if len(groups) > 8 else 0)
        ax.set_xlabel(GROUP_AXIS.get(p.distribution["grouping"], ""), fontsize=8)
        ax.set_ylabel("step time (ms)", fontsize=8)
        strag = ", ".join(str(s["rank"]) for s in p.stragglers)
        title = p.name if report.kind == "tune" else f"{p.world_size} rank(s)"
        ax.set_title(title + (f" - straggler: {strag}" if strag else ""), fontsize=9,
                     color=COLORS["straggler"] if strag else "black")
    return fig


def predicted_figure(report: ScalingReport) -> Figure:
    """Measured against predicted step time per world size or tune trial (or why there is none)."""
    fig = _figure()
    ax = fig.add_subplot()
    rows = _ok_rows(report)
    labels = [str(r.world_size) for r in rows]
    if report.tune is not None:  # one bar pair per measured trial
        rows = [Row(world_size=report.tune.world_size, repeats_ok=1, repeats=1, step_time_s=t.measured_step_s,
                    predicted_step_time_s=t.predicted_step_s, predicted_interval_s=t.predicted_interval_s)
                for t in report.tune.trials if t.measured_step_s]
        labels = [t.run_name for t in report.tune.trials if t.measured_step_s]
    if not any(r.predicted_step_time_s for r in rows):
        ax.text(0.5, 0.55, "Predicted vs measured", ha="center", va="center", fontsize=13)
        note = report.prediction_note or "prediction unavailable"
        ax.text(0.5, 0.4, textwrap.fill(note, 70), ha="center", va="center", fontsize=9, color="#555")
        ax.set_axis_off()
        return fig
    xs = list(range(len(rows)))
    meas = [1000 * (r.step_time_s or 0) for r in rows]
    pred = [1000 * (r.predicted_step_time_s or 0) for r in rows]
    ax.set_title("Predicted vs measured step time (label: measured / predicted)", fontsize=10)
    ax.bar([x - 0.2 for x in xs], meas, 0.4, color=COLORS["measured"], label="measured (median)")
    ax.bar([x + 0.2 for x in xs], pred, 0.4, color=COLORS["predicted"], label="predicted")
    spans = [(x, r.predicted_interval_s) for x, r in zip(xs, rows) if r.predicted_interval_s]
    if spans:  # the plan's 80% interval from the model's validation, as a whisker
        ax.vlines([x + 0.2 for x, _ in spans], [1000 * s[0] for _, s in spans],
                  [1000 * s[1] for _, s in spans], color="black", linewidth=1.2, label="predicted 80% interval")
    for x, m, p in zip(xs, meas, pred):
        if p:
            ax.annotate(f"{m / p:.2f}x", (x, max(m, p)), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(xs, labels, rotation=20 if report.tune is not None else 0, fontsize=8)
    ax.set_xlabel("trial" if report.tune is not None else "world size (ranks)")
    ax.set_ylabel("step time (ms)")
    _value_axis(ax, meas + [p for p in pred if p])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def _value_axis(ax: Any, values: Sequence[float]) -> None:
    """Linear from 0, or logarithmic when the values span more than 20x (a prediction far
    off the measurement must not flatten the measured curve)."""
    vals = [v for v in values if v and v > 0]
    if vals and max(vals) / min(vals) > 20:
        ax.set_yscale("log")
        ax.set_title(ax.get_title() + " (log scale)", fontsize=10)
    else:
        ax.set_ylim(bottom=0)


def _world_axis(ax: Any, sizes: list[int]) -> None:
    ax.set_xlabel("world size (ranks)")
    if sizes and max(sizes) / max(1, min(sizes)) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])


def _point_label(p: Point, report: ScalingReport) -> str:
    if report.kind == "run":
        return f"{p.world_size} rank(s)"
    if report.kind == "tune":
        return p.name
    reps = max((q.repeat for q in report.points if q.world_size == p.world_size), default=0)
    return f"{p.world_size}" + (f" r{p.repeat}" if reps else "")


def build_plots(report: ScalingReport) -> list[Plot]:
    """Every figure the report shows (a single run or a tune's trials: breakdown, ranks, prediction)."""
    specs = []
    if report.kind not in ("run", "tune"):
        specs += [("throughput", "Throughput against world size", throughput_figure,
                   "Measured throughput (median over repeats, bars min-max) with the ideal "
                   "linear line from the smallest world size."),
                  ("efficiency", "Scaling efficiency", efficiency_figure,
                   f"{report.mode.capitalize()} scaling efficiency relative to "
                   f"{report.baseline_world_size} rank(s).")]
    specs += [("breakdown", "Step-time breakdown", breakdown_figure,
               "Mean optimizer step split into compute, exposed communication (sync-off/on "
               "calibration), batch wait and other (optimizer, host overhead)."),
              ("ranks", "Per-rank step times", ranks_figure,
               "Step-time distribution of each rank (grouped when there are more than 64); "
               "red: straggler (median > 110% of the median of medians)."),
              ("predicted", "Predicted vs measured", predicted_figure,
               report.prediction_note or ("Each trial's median step (after warm-up) against its candidate's "
                                          "predicted step time." if report.kind == "tune" else
                                          "The planner's cost model for the same points."))]
    return [Plot(key, title, caption, *render(make(report))) for key, title, make, caption in specs]
