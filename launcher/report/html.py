"""The self-contained HTML page: inline CSS, inline SVG figures, no scripts, no network.

It opens from a file in any browser (and in headless Chromium in the tests).

Never imports cli, backends, jobs or runtime, nor matplotlib (the figures come in drawn).
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.report.plots import Plot
from launcher.report.tune import HEAD, cells, outcome_lines, relative
from launcher.report.types import GROUP_AXIS, Point, ScalingReport, dash
from launcher.results.prediction import prediction_cell

CSS = """
body{font:14px/1.45 -apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;margin:0;
  color:#1d1d1f;background:#fafafa}
main{max-width:1360px;margin:0 auto;padding:20px 24px 48px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid #ddd;
  padding-bottom:4px}
.meta{color:#555;font-size:13px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-left:5px solid #4C72B0;border-radius:4px;
  padding:8px 12px;min-width:220px;flex:1 1 260px}
.card.comm{border-left-color:#DD8452}.card.data{border-left-color:#C44E52}
.card.failed{border-left-color:#000;background:#fff4f4}
.card b{display:block;font-size:15px}
.card small{color:#555}
.figs{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:16px}
figure.plot{margin:0;background:#fff;border:1px solid #ddd;border-radius:4px;padding:8px}
figure.plot svg{max-width:100%;height:auto;display:block;margin:0 auto}
figure.plot.wide{grid-column:1/-1}
figcaption{font-size:12px;color:#444;margin-top:4px}
table{border-collapse:collapse;background:#fff;font-size:13px;width:100%}
div.scroll{overflow-x:auto}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:right;white-space:nowrap}
th{white-space:normal;vertical-align:bottom}
td.wrap{white-space:normal;text-align:left;min-width:120px;max-width:260px}
th{background:#f0f0f0} td:first-child,th:first-child{text-align:left}
td.bad{color:#b00020;font-weight:600} span.bad{color:#b00020;font-weight:600}
tr.chosen td{background:#eef6ee;font-weight:600}
.warn{background:#fff8e1;border:1px solid #f0d58c;border-radius:4px;padding:6px 10px;margin:4px 0}
ul.notes{margin:4px 0;padding-left:20px;color:#333}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _card_class(p: Point) -> str:
    name = p.verdict.get("name", "")
    return ("card failed" if p.status != "ok" else "card comm" if name.startswith("communication")
            else "card data" if name.startswith("data") else "card")


def verdict_cards(report: ScalingReport) -> str:
    """One card per point: its bottleneck and the evidence, or why it failed."""
    cards = []
    for p in report.points:
        if p.status != "ok":
            name, why = p.status.upper(), p.error or (p.failures[0] if p.failures else p.status)
        else:
            v = p.verdict or {"name": "no verdict", "evidence": ""}
            src = f" (from {v.get('source')})" if v.get("source") else ""
            if p.status_text and p.status_text != p.status:
                v = {"name": p.status_text, "evidence": "the run exited 0 without recording a step"}
            name, why = v["name"], v.get("evidence", "") + src
        cards.append(f'<div class="{_card_class(p)}"><b>{_e(p.name)}: {_e(name)}</b><small>{_e(why)}</small></div>')
    return '<div class="cards" id="verdicts">' + "".join(cards) + "</div>"


def run_table(report: ScalingReport) -> str:
    """Every point: status, batch, throughput, efficiency, shares, busbw, stragglers, prediction."""
    units = report.sample_units
    eff = {r.world_size: r for r in report.rows}
    head = ["point", "ranks", "status", "global batch", "samples/s", *([f"{units}/s"] if units != "samples" else []),
            "step (median)", "efficiency", "predicted eff.", "exposed comm", "batch wait", "busbw / link GB/s",
            "stragglers", "predicted vs measured", "verdict"]
    rows = []
    for p in report.points:
        row = eff.get(p.world_size)
        ok = p.status == "ok"
        link = (f" / {p.link_bw_gb_s:g} {p.link_kind}"
                + (f" ({_pct(p.busbw_of_link)})" if p.busbw_of_link is not None else "") if p.link_bw_gb_s else "")
        measured = ok and p.step_time_s > 0  # a run that reported no steps has no rates
        strag = ", ".join(f"{s['rank']} ({s['host']}/{s['local_rank']})" for s in p.stragglers)
        cells = [_e(p.name), str(p.world_size),
                 f'<span class="{"" if ok else "bad"}">{_e(p.status_text or p.status)}</span>',
                 dash(p.global_batch, "{:d}"), dash(p.samples_per_s if measured else None, "{:,.1f}"),
                 *([dash(p.units_per_s if measured else None, "{:,.0f}")] if units != "samples" else []),
                 dash(p.step_time_s if measured else None, "{:.4f} s"),
                 _pct(row.efficiency if row and p.repeat == 0 else None),
                 _pct(row.predicted_efficiency if row and p.repeat == 0 else None),
                 "-" if p.exposed_comm_s is None else
                 f"{1000 * p.exposed_comm_s:.1f} ms ({_pct(p.shares.get('exposed_comm'))})",
                 _pct(p.shares.get("data_wait") if p.shares else None), dash(p.busbw_gb_s, "{:.3g}") + _e(link),
                 f'<span class="bad">{_e(strag)}</span>' if strag else "-",
                 _e(prediction_cell(p.prediction)) if p.run_id else "-",
                 _e(p.verdict.get("name", "-") if p.verdict else (p.error or "-"))]
        # the long text cells wrap, so the table fits the page and no column is cut off
        tds = [f"<td>{c}</td>" for c in cells[:-3]] + [f'<td class="wrap">{c}</td>' for c in cells[-3:]]
        rows.append("<tr>" + "".join(tds) + "</tr>")
    return ('<div class="scroll"><table id="runs"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")


def slowest_ranks_table(report: ScalingReport, limit: int = 8) -> str:
    """The slowest groups of the largest point (readable even with thousands of ranks)."""
    p = max((q for q in report.points if q.distribution.get("groups")), key=lambda q: q.world_size, default=None)
    if p is None:
        return ""
    groups = sorted(p.distribution["groups"], key=lambda g: g["p50"], reverse=True)[:limit]
    what = GROUP_AXIS.get(p.distribution["grouping"], "")
    title = {"rank": "ranks", "node": "nodes", "rank block": "rank blocks"}.get(p.distribution["grouping"], "ranks")
    rows = "".join(
        f"<tr><td>{_e(g['label'])}</td><td>{1000 * g['p50']:.2f}</td><td>{1000 * g['p95']:.2f}</td>"
        f"<td>{1000 * g['max']:.2f}</td><td>{'yes' if g['straggler'] else ''}</td></tr>" for g in groups)
    return (f"<h2>Slowest {_e(title)} of {_e(p.name)}</h2><table id=\"slowest\"><thead><tr>"
            f"<th>{_e(what)}</th><th>median ms</th><th>p95 ms</th><th>max ms</th><th>straggler</th>"
            f"</tr></thead><tbody>{rows}</tbody></table>")


def scoped_svg(svg: str, prefix: str) -> str:
    """Prefix every id of an SVG (and the references to it): matplotlib names font glyphs
    after the character, so several inline SVGs would otherwise share ids in one page."""
    ids = set(re.findall(r'\sid="([^"]+)"', svg))

    def fix(m: re.Match[str]) -> str:
        return f"{m.group(1)}{prefix}-{m.group(2)}" if m.group(2) in ids else m.group(0)

    return re.sub(r'(\sid="|href="#|url\(#)([^")]+)', fix, svg)


def figures_html(plots: Sequence[Plot]) -> str:
    """Each plot as an inline SVG in a <figure> with its caption."""
    return '<div class="figs">' + "".join(
        f'<figure class="plot{" wide" if p.key == "ranks" else ""}" id="fig-{_e(p.key)}" data-plot="{_e(p.key)}">'
        f"{scoped_svg(p.svg, 'f-' + p.key)}<figcaption><b>{_e(p.title)}.</b> {_e(p.caption)}</figcaption></figure>"
        for p in plots) + "</div>"


def notes_html(report: ScalingReport) -> str:
    """What could not be read, failures, and why a column is empty (`ScalingReport.note_lines`)."""
    items = report.note_lines()
    return ('<h2>Notes</h2><ul class="notes" id="notes">' + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>"
            if items else "")


def tune_html(report: ScalingReport, out_dir: Path | None) -> str:
    """A tune dir's table, each trial linked to its run dir and its report if any, then `outcome_lines`."""
    tune = report.tune
    if tune is None:
        return ""
    rows = []
    for t in tune.trials:
        c = [_e(x) for x in cells(t)]
        if t.run_dir is not None:
            c[0] = f'<a href="{_e(relative(t.run_dir, out_dir))}">{c[0]}</a>'
        c[1] = f'<span class="{"" if t.status == "ok" else "bad"}">{c[1]}</span>'
        page_link = (f'<a href="{_e(relative(t.report_html, out_dir))}">report</a>' if t.report_html
                     else f"- (<code>dlaunch report {_e(t.run_dir)}</code>)" if t.run_dir else "-")
        rows.append(('<tr class="chosen">' if t.chosen else "<tr>") + "".join(f"<td>{x}</td>" for x in c)
                    + f'<td class="wrap">{page_link}</td></tr>')
    head = "".join(f"<th>{_e(h)}</th>" for h in (*HEAD, "trial report"))
    return (f"<h2>Tune</h2><p class=\"meta\">{len(tune.trials)} trial(s) on {tune.world_size} rank(s), same "
            "seed and data; measured/predicted is the measured median step (after warm-up) over the "
            "predicted step time</p>"
            f'<div class="scroll"><table id="tune"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}'
            '</tbody></table></div><ul class="notes" id="tune-outcome">'
            + "".join(f"<li>{_e(x)}</li>" for x in outcome_lines(tune)) + "</ul>")


def page(report: ScalingReport, plots: Sequence[Plot], *, out_dir: Path | None = None) -> str:
    """The whole HTML document; `out_dir` (where it goes) makes its links relative."""
    what = {"sweep": "scaling sweep", "runs": "runs", "run": "run", "tune": "tune"}[report.kind]
    title = f"dlaunch report: {what} {report.source.rstrip('/').split('/')[-1]}"
    worlds = ", ".join(str(r.world_size) for r in report.rows)
    meta = (f"{_e(report.headline())} &middot; world sizes\n{_e(worlds)}" if report.tune is None
            else f"{len(report.tune.trials)} candidate(s) on {report.tune.world_size} rank(s)")
    warn = "".join(f'<div class="warn">STRAGGLER in {_e(p.name)}: rank {s["rank"]} on {_e(s["host"])} '
                   f'(local rank {s["local_rank"]}), median step {1000 * s["median_s"]:.1f} ms; '
                   f'{_e(s["signal"])}</div>' for p in report.points for s in p.stragglers)
    warn += "".join(f'<div class="warn">WARNING: {_e(w)}</div>' for w in report.warnings)
    if unreadable := sum(len(p.unreadable) for p in report.points):
        warn += f'<div class="warn">{unreadable} file problem(s): the report shows what was readable; see Notes</div>'
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{_e(title)}</title><style>{CSS}</style></head>
<body><main>
<h1>{_e(title)}</h1>
<p class="meta">{_e(report.source)} &middot; {meta} &middot; generated
{_e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))}</p>
{warn}
{tune_html(report, out_dir)}
<h2>Bottleneck verdicts</h2>
{verdict_cards(report)}
<h2>Figures</h2>
{figures_html(plots)}
<h2>Runs</h2>
{run_table(report)}
{slowest_ranks_table(report)}
{notes_html(report)}
</main></body></html>
"""
