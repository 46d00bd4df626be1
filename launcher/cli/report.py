"""`dlaunch report DIR`: the report (HTML, Markdown, JSON, PNG) of a run, sweep or tune directory
(`dlaunch tune`'s, recognised by its tune.json), and the summary lines `scale` prints after a
sweep too. Must never import torch; matplotlib stays inside launcher.report's plotting.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
from pathlib import Path

from launcher.cli.options import ReportOptions, load
from launcher.hardware.detect import detect_topology
from launcher.hardware.topology import load_topology
from launcher.hardware.types import Topology
from launcher.report.render import parse_formats, render_report, summary_lines
from launcher.report.types import ScalingReport
from launcher.rundir import RunPaths

log = logging.getLogger(__name__)


def print_report(path: Path, report: ScalingReport | None, files: list[Path]) -> None:
    """The report's summary lines and where its files went."""
    print(f"{'tune' if report is not None and report.kind == 'tune' else 'sweep/run'}: {path}")
    if report is not None:
        print("\n".join(summary_lines(report)))
    html = next((f for f in files if f.suffix == ".html"), None)
    if html is not None:
        print(f"report: {html}")
    elif files:
        print(f"report: {files[0].parent}/ ({', '.join(f.name for f in files)})")


def _run_host(path: Path) -> str | None:
    """The host that ran rank 0 of the first run under `path`, from its start record."""
    for candidate in [path, *sorted(path.glob("*/"))][:50]:
        f = RunPaths(root=candidate).records(0)
        if f.is_file():
            with open(f, encoding="utf-8", errors="replace") as fh:
                try:
                    return str(json.loads(fh.readline()).get("host"))
                except ValueError:
                    return None
    return None


def cmd_report(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch report`: HTML / Markdown / JSON / PNG of a run, sweep or tune directory."""
    opts = load(ReportOptions, args)
    formats = parse_formats(opts.format)
    path = Path(opts.path)
    topology = load_topology(opts.topology) if opts.topology else None
    fallback: Topology | None = None
    if topology is None and path.is_dir() and _run_host(path) == socket.gethostname().split(".")[0]:
        try:
            fallback = detect_topology()
        except Exception as e:  # only the link column and the prediction need it
            log.warning("could not detect this machine's topology: %s", e)
    files, report = render_report(path, formats, out_dir=opts.out, topology=topology,
                                  default_topology=fallback, with_prediction=not opts.no_predict)
    if opts.json:
        print(json.dumps({**report.to_dict(), "files": [str(f) for f in files]}, indent=2))
    else:
        print_report(path, report, files)
    return 0
