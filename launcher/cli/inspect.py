"""`dlaunch inspect`: this machine (and its SLURM job, if any) as the planner sees it.

Must never import torch: detection reads NVML, /proc and /sys, not CUDA.
"""

from __future__ import annotations

import argparse
import json

from launcher.cli.options import InspectOptions, load
from launcher.hardware.detect import detect_topology
from launcher.hardware.view import format_topology, inspect_report


def cmd_inspect(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch inspect`: this machine as a Topology, as text or as JSON."""
    opts = load(InspectOptions, args)
    topology = detect_topology()
    print(json.dumps(inspect_report(topology), indent=2) if opts.json else format_topology(topology))
    return 0
