"""A tune directory in a report: its tune.json read into a `TuneSummary`, and the tune's table
(candidate, status, predicted and measured step time and samples/s, measured/predicted, chosen)
as cells, Markdown and terminal lines; the HTML page draws the same cells (`html`).

A trial's run dir is found by its name under the tune dir, never by the absolute path tune.json
recorded, so a tune dir that was moved or copied still reports. Reads, never writes; never
imports cli, backends, jobs or runtime.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from launcher.files import read_json
from launcher.report.types import HTML_PAGE, TuneSummary, TuneTrial, dash
from launcher.results.schema import kind_of
from launcher.results.table import format_table
from launcher.rundir import TUNE_RECORD, TunePaths

log = logging.getLogger(__name__)

HEAD = ("candidate", "status", "predicted step", "predicted samples/s", "measured step",
        "measured samples/s", "measured/predicted", "chosen")
CAPTION = ("same seed and data; measured/predicted is the measured median step (after warm-up) over the predicted"
           " (in brackets: the plan's 80% interval)")


def _trial(tune: TunePaths, row: Mapping[str, Any]) -> TuneTrial:
    run_name = Path(str(row["run_dir"])).name
    trial = tune.trial(run_name)
    page = trial.report / HTML_PAGE
    measured, predicted = row.get("measured_step_s"), row["predicted_step_s"]
    return TuneTrial(
        name=str(row["name"]), run_name=run_name, status=row["status"], reason=str(row.get("reason") or ""),
        predicted_step_s=predicted, predicted_samples_per_s=row["predicted_samples_per_s"],
        predicted_interval_s=_interval(row.get("predicted_interval_s")),
        measured_step_s=measured, measured_samples_per_s=row.get("measured_samples_per_s"),
        step_ratio=measured / predicted if isinstance(measured, (int, float)) and isinstance(
            predicted, (int, float)) and predicted > 0 else None,
        chosen=row.get("chosen") is True, run_dir=str(trial.root.absolute()) if trial.root.is_dir() else None,
        report_html=str(page.absolute()) if page.is_file() else None)


def _interval(found: Any) -> tuple[float, float] | None:
    """tune.json's [low, high] around a trial's prediction (None in a tune from before)."""
    if (isinstance(found, list) and len(found) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in found)):
        return float(found[0]), float(found[1])
    return None


def _workload(tune: TunePaths) -> str:
    """The workload tuned-plan.json names ("" without a readable one): for the command line."""
    try:
        data = read_json(tune.tuned_plan)
    except (OSError, ValueError):
        return ""
    return str(data.get("workload") or "") if isinstance(data, dict) else ""


def read_tune(path: Path) -> tuple[TuneSummary | None, list[str]]:
    """The tune in `path`, and notes; (None, [why]) when its tune.json is not one `dlaunch tune`
    wrote (the caller reports the trials as plain runs then)."""
    tune = TunePaths(root=path)
    try:
        data = read_json(tune.record)
    except (OSError, ValueError) as e:
        return None, [f"{TUNE_RECORD}: unreadable ({e}); the trials are reported as plain runs"]
    try:
        if not isinstance(data, dict) or not isinstance(data.get("trials"), list):
            raise ValueError(f"expected an object with a list of trials, got {kind_of(data)}")
        trials = tuple(_trial(tune, row) for row in data["trials"])
        summary = TuneSummary(world_size=data["world_size"], trials=trials, workload=_workload(tune),
                              tuned_plan=str(tune.tuned_plan.absolute()) if tune.tuned_plan.is_file() else None)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        log.debug("%s not a tune record", tune.record, exc_info=True)
        return None, [f"{TUNE_RECORD}: not a dlaunch tune record ({type(e).__name__}: {e}); the trials "
                      "are reported as plain runs"]
    notes = []
    if summary.tuned_plan is None and summary.chosen is not None:
        notes.append(f"{tune.tuned_plan.name}: missing, though {summary.chosen.name} was chosen")
    return summary, notes


def cells(t: TuneTrial) -> list[str]:
    """One trial's row under HEAD, as text; "-" where nothing was measured."""
    span = t.predicted_interval_s
    return [t.name, t.status, f"{t.predicted_step_s:.3g} s" + (f" ({span[0]:.3g}-{span[1]:.3g})" if span else ""),
            f"{t.predicted_samples_per_s:,.1f}",
            dash(t.measured_step_s, "{:.3g} s"), dash(t.measured_samples_per_s, "{:,.1f}"),
            dash(t.step_ratio, "{:.2f}"), "yes" if t.chosen else ""]


def outcome_lines(summary: TuneSummary) -> list[str]:
    """Why each trial that did not finish stopped, and where the tuned plan is."""
    out = [f"{t.status.upper()}: {t.name} ({t.run_name}): {t.reason or 'no reason recorded'}"
           for t in summary.trials if t.status != "ok"]
    chosen = summary.chosen
    if summary.tuned_plan and chosen is not None:
        out.append(f"tuned plan: {summary.tuned_plan} ({chosen.name}, the fastest measured); follow it "
                   f"with `dlaunch run {summary.workload or 'WORKLOAD'} --plan {summary.tuned_plan}`")
    else:
        out.append("no tuned plan: no trial finished")
    return out


def markdown_lines(summary: TuneSummary, *, link_from: Path | None) -> list[str]:
    """The tune's section of report.md: the table, then the outcome lines."""
    lines = ["## Tune", "", f"{len(summary.trials)} trial(s) on {summary.world_size} rank(s), {CAPTION}", "",
             "| " + " | ".join(HEAD) + " | trial report |", "|---|---|" + "---:|" * 5 + "---|---|"]
    for t in summary.trials:
        link = f"[report]({relative(t.report_html, link_from)})" if t.report_html else "-"
        lines.append("| " + " | ".join(cells(t)) + f" | {link} |")
    return [*lines, "", *(f"- {x}" for x in outcome_lines(summary)), ""]


def table_text(summary: TuneSummary, tune_dir: Path) -> str:
    """What `dlaunch tune` prints when it is done: the table, the outcome lines, where the trials are."""
    return "\n".join([f"tune: {len(summary.trials)} trial(s) on {summary.world_size} rank(s), {CAPTION}",
                      format_table(HEAD, [cells(t) for t in summary.trials]), *outcome_lines(summary),
                      f"trials: {tune_dir}/<n>-<candidate>/; {TUNE_RECORD} beside them"])


def terminal_lines(summary: TuneSummary) -> list[str]:
    """What `dlaunch report TUNE_DIR` prints about the trials."""
    rows = []
    for t in summary.trials:
        _, status, step, rate, m_step, m_rate, ratio, _ = cells(t)
        measured = ("not measured" if t.measured_step_s is None else
                    f"measured {m_step}/step, {m_rate} samples/s, measured/predicted {ratio}")
        rows.append(f"  {t.run_name}: {status}; predicted {step}/step, {rate} samples/s; {measured}"
                    + ("  <- chosen" if t.chosen else ""))
    return rows + [f"  {x}" for x in outcome_lines(summary)]


def relative(target: str, start: Path | None) -> str:
    """`target` as a link from a page in `start` (relative, so a copied report folder works)."""
    if start is None:
        return Path(target).as_uri()
    return os.path.relpath(target, start.absolute())  # pathlib's relative_to cannot go up
