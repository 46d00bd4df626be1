"""`dlaunch doctor`'s terminal report: the table of ranks and nodes, the expected figures and
the closing verdict lines (what results.doctor judged).

Pure text from a DoctorReport; never imports cli, backends, jobs, runtime or report.
"""

from __future__ import annotations

from collections.abc import Sequence

from launcher.results.doctor import CHECK_NAMES, RANK_CHECKS, DoctorReport, NodeRow, Verdict, fmt_rate, rate_unit
from launcher.results.table import format_table


def _cell(v: Verdict | None, device: str) -> str:
    """`measured / expected  NN%` (of expected), or the measured number alone."""
    if v is None:
        return "-"
    text = fmt_rate(v.check, v.measured, device)
    if v.expected is not None:
        text += f" / {fmt_rate(v.check, v.expected.value, device)}"
        if (share := v.of_expected) is not None:
            text += f" {share:4.0%}"
    return text


def _why(verdicts: Sequence[Verdict]) -> str:
    if not (slow := [v for v in verdicts if v.slow]):
        return "ok"
    return "SLOW: " + ", ".join(f"{CHECK_NAMES[v.check]} {v.of_median:.0%}" for v in slow) + " of the median"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def header_lines(report: DoctorReport) -> list[str]:
    """What ran, what it is judged against, and the rule."""
    good = [r.reading for r in report.ranks]
    world = max([r.world_size for r in good] + [len(good) + len(report.failed)])
    where = f"{len(report.nodes) or 1} node(s) of a SLURM job" if report.slurm else "this host"
    lines = [f"dlaunch doctor: {world} rank(s) on {where}"]
    if good:
        r = good[0]
        threads = f", {r.threads} thread(s) per rank" if r.device == "cpu" else ""
        lines[0] += f", {r.device_name or r.device}{threads}"
        lines.append(f"checks: GEMM {r.precision} {r.gemm_n}^3, copy {_size(r.copy_bytes / 2)} "
                     f"({_size(r.copy_bytes)} read + written)"
                     + (f", all-reduce {_size(r.allreduce_bytes)}" if r.allreduce_bytes else ""))
    return lines + [f"expected: {report.expectations.basis}",
                    f"verdict: SLOW below {report.threshold:.0%} of the median rank (node); "
                    "measured / expected and its share in each cell"]


def format_doctor(report: DoctorReport) -> str:
    """The terminal report: one line per rank, one per node, the expectations, the verdict."""
    dev = report.device
    lines = header_lines(report) + [""]
    rows = [[str(r.reading.rank), str(r.reading.node), r.reading.host, r.reading.label,
             *(_cell(next((v for v in r.verdicts if v.check == c), None), dev) for c in RANK_CHECKS),
             _why(r.verdicts) + (" (slowed by the test hook)" if r.reading.slowed else "")] for r in report.ranks]
    rows += [[str(f.rank), str(f.node) if f.host != "?" else "-", f.host,
              f.label if f.host != "?" else "-", "-", "-", f"{f.status.upper()}: {f.error}"] for f in report.failed]
    rows.sort(key=lambda row: int(row[0]))
    lines += format_table(["rank", "node", "host", "device", f"GEMM {rate_unit('gemm', dev)}",
                           "copy GB/s", "verdict"], rows, right=False).splitlines()
    if any(n.allreduce for n in report.nodes) or len(report.nodes) > 1:
        nrows = [[str(n.node), n.host, str(len(n.ranks)), _cell(n.allreduce, dev),
                  ("SLOW" if n.bad else "ok") + _node_why(n)] for n in report.nodes]
        lines += ["", *format_table(["node", "host", "ranks", "all-reduce busbw GB/s", "verdict"], nrows,
                                    right=False).splitlines()]
    if report.world is not None:
        w = report.world
        line = f"all-reduce across nodes: busbw {fmt_rate(w.check, w.measured)} GB/s"
        if w.expected is not None and w.of_expected is not None:
            line += f", expected {fmt_rate(w.check, w.expected.value)} GB/s ({w.of_expected:.0%})"
        lines.append(line)
    if any_expected := any(e is not None for e in report.expectations.checks.values()):
        lines += ["", "expected figures:"]
    for check, exp in report.expectations.checks.items():
        if exp is not None and _measured(report, check):
            lines.append(f"  {CHECK_NAMES[check]}: {fmt_rate(check, exp.value, dev)} {rate_unit(check, dev)}"
                         f" - {exp.source}")
        elif check in report.expectations.missing and _measured(report, check) and any_expected:
            lines.append(f"  {CHECK_NAMES[check]}: none ({report.expectations.missing[check]})")
    lines += [""] + list(report.notes) if report.notes else []
    lines += [""] + verdict_lines(report)
    return "\n".join(lines)


def _measured(report: DoctorReport, check: str) -> bool:
    if check in RANK_CHECKS:
        return bool(report.ranks)
    if check == "allreduce_node":
        return any(n.allreduce for n in report.nodes)
    return report.world is not None


def _node_why(n: NodeRow) -> str:
    parts = [f"slow rank(s) {', '.join(map(str, n.slow_ranks))}" if n.slow_ranks else "",
             f"failed rank(s) {', '.join(map(str, n.failed_ranks))}" if n.failed_ranks else "",
             f"all-reduce {n.allreduce.of_median:.0%} of the median" if n.allreduce and n.allreduce.slow else ""]
    return f": {'; '.join(p for p in parts if p)}" if any(parts) else ""


def verdict_lines(report: DoctorReport) -> list[str]:
    """The closing lines: every SLOW or failed rank and node named, the --exclude value."""
    dev = report.device
    out = [f"SLOW: rank {r.reading.rank} ({r.reading.label} on {r.reading.host}, node {r.reading.node}): "
           f"{CHECK_NAMES[v.check]} {fmt_rate(v.check, v.measured, dev)} {rate_unit(v.check, dev)} is "
           f"{v.of_median:.0%} of the median {fmt_rate(v.check, v.median, dev)}"
           for r in report.ranks for v in r.verdicts if v.slow]
    out += [f"SLOW: node {n.node} ({n.host}): all-reduce busbw {fmt_rate('allreduce_node', n.allreduce.measured)} "
            f"GB/s is {n.allreduce.of_median:.0%} of the median node's"
            for n in report.nodes if n.allreduce and n.allreduce.slow]
    out += [f"{f.status.upper()}: rank {f.rank} (host {f.host}): {f.error}" for f in report.failed]
    if report.ok:
        out.append(f"ok: every rank within {report.threshold:.0%} of the median"
                   + (" (one rank: nothing to compare with)" if len(report.ranks) == 1 else ""))
    elif report.exclude:
        hosts = ",".join(report.exclude)
        out.append(f"exclude: --exclude={hosts}  (sbatch; with dlaunch: --slurm-opt exclude={hosts})")
    return out
