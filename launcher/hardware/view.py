"""What `dlaunch inspect` prints: a `Topology` as text for people or as a JSON-ready dict.

Never imports plan, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from launcher.hardware.detect import slurm_allocation, unknown_speed_nics
from launcher.hardware.topology import topology_to_dict
from launcher.hardware.types import Link, Topology


def inspect_report(t: Topology, *, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A JSON-ready dict for `dlaunch inspect --json`: the topology, links and SLURM job."""
    slurm = slurm_allocation(env)
    return {
        "topology": topology_to_dict(t), "world_size": t.world_size,
        "backend": "nccl" if t.device == "cuda" else "gloo", "bf16": t.accelerator.supports_bf16,
        "device_links": [list(row) for row in t.device_links],
        # the link figures are stored estimates (topology files, NIC line rates): inspect measures none
        "link_figures": "assumed", "nics_speed_unknown": list(_unknown_nics(t)),
        "slurm": dataclasses.asdict(slurm) if slurm else None,
    }


_SHORT = {"nvswitch": "NVS", "nvlink": "NV", "pcie": "PCIe", "pcie-nop2p": "noP2P", "": "X"}


def _link_line(label: str, link: Link) -> str:
    return (f"{label:<11}{link.kind}: {link.bw_gb_s:g} GB/s busbw, {link.latency_us:g} us/step "
            "(assumed, not measured here)")


def _unknown_nics(t: Topology) -> tuple[str, ...]:
    """Interfaces up on this machine without a reported speed, for a topology detected here."""
    return unknown_speed_nics() if t.source.startswith("detected on") else ()


def format_topology(t: Topology, *, env: Mapping[str, str] | None = None) -> str:
    """Human-readable text for `dlaunch inspect`: devices, link matrix, NICs, cores, SLURM."""
    acc = t.accelerator
    peaks = " | ".join(f"{k} {v:g}" for k, v in acc.peak_tflops.items())
    lines = [f"Topology   {t.name}: {t.num_nodes} node(s) x {t.devices_per_node} "
             f"{t.device} device(s) = {t.world_size} ranks"]
    if t.device == "cuda":
        cc = f"{acc.compute_capability[0]}.{acc.compute_capability[1]}" if acc.compute_capability else "?"
        lines.append(f"{'GPU':<5}{'name':<40}{'memory':>11}{'cc':>6}")
        lines += [f"{i:<5}{acc.name[:39]:<40}{acc.mem_gib:>7.1f} GiB{cc:>6}" for i in range(t.devices_per_node)]
        lines.append(f"Peak       TFLOP/s dense: {peaks}; bf16 "
                     f"{'supported' if acc.supports_bf16 else 'not supported (use fp16)'}")
    else:
        lines += [f"Device     {acc.name}: {acc.mem_gib:g} GiB, TFLOP/s {peaks}",
                  f"Backend    gloo over shared memory between {t.devices_per_node} processes on one host"]
    if t.device_links:
        lines.append("Links      " + "".join(f"{'GPU' + str(j):>7}" for j in range(len(t.device_links))))
        lines += [f"{'  GPU' + str(i):<11}" + "".join(f"{_SHORT.get(c, c):>7}" for c in row)
                  for i, row in enumerate(t.device_links)]
    lines.append(_link_line("Intra-node", t.intra_node))
    if t.inter_node:
        lines.append(_link_line("Inter-node", t.inter_node))
    groups: dict[tuple[str, float], list[str]] = {}
    for nic in t.nics:  # 8 identical rails read better as one line
        groups.setdefault((nic.kind, nic.speed_gbit_s), []).append(nic.name)
    listed = [f"{len(names)}x {kind} {speed:g} Gb/s "
              f"({', '.join(names) if len(names) < 3 else names[0] + ' .. ' + names[-1]})"
              for (kind, speed), names in groups.items()]
    if unknown := _unknown_nics(t):
        listed.append(f"{len(unknown)}x ethernet speed unknown ({', '.join(unknown)})")
    lines += [f"NICs       {', '.join(listed) or 'none'} per node", f"CPU cores  {t.cpu_cores_per_node} per node"]
    if t.host is not None:
        lines.append(f"Host       {t.host.mem_gib:,.1f} GiB memory per node; "
                     + (f"{t.host.link_gb_s:g} GB/s to each GPU, " if t.device == "cuda" else "")
                     + f"{t.host.mem_bw_gb_s:g} GB/s memory bandwidth (assumed) for CPU offload")
    if slurm := slurm_allocation(env):
        gpus = slurm.gpus_per_node if slurm.gpus_per_node is not None else "?"
        lines.append(f"SLURM      job {slurm.job_id}: {slurm.num_nodes} node(s) [{slurm.nodelist or '?'}], "
                     f"{gpus} GPU(s)/node, partition {slurm.partition or '?'}")
    return "\n".join(lines)
