"""CPU offload (FSDP2's `CPUOffloadPolicy`, strategy field `offload`): what it keeps in host
memory and what it adds to a GPU step.

With the policy each rank's shard of the fp32 parameters, their gradients and the optimizer's
state live in pinned host memory, and FSDP2 (torch.distributed.fsdp._fully_shard):
- copies a unit's fp32 shard to the GPU before each all-gather (`FSDPParam.all_gather_inputs`):
  a unit that reshards after forward (full shard, hybrid) crosses the host link twice per
  micro-batch, in forward and in backward's re-gather; grad-op once. The copies run on the
  all-gather stream, behind the other units' compute;
- copies each reduce-scattered fp32 gradient shard back to the host in backward, priced after
  backward's copies in, not beside them: a 7B model's step on one H200 took 3.67 s, of which its
  fused AdamW at the rate FSDP2 reached on that host is 1.6 s, leaving 2.0 s to forward, backward
  and 4 B a parameter three times over the 55 GB/s link: more than the three crossings one after
  another (1.5 s), twice the directions overlapped (1.0 s) (benchmarks/host_offload.py);
- under accumulation adds each micro-batch's gradient shard to the host copy on the CPU;
- and the optimizer then steps on the CPU over the host shard, after backward: nothing hides it.

Pure arithmetic on the frozen specs (no torch, no I/O); the link and the host's memory bandwidth
come from the topology (`Host`), where each figure has its source or is labelled assumed.
"""

from __future__ import annotations

from launcher.errors import PlanError
from launcher.hardware.types import Topology
from launcher.plan.memory import optimizer_step_share
from launcher.specs import GIB, ModelProfile, Strategy

NO_HOST = ("CPU offload: topology {} does not describe its hosts (memory, the link to each GPU, "
           "memory bandwidth); add a `host:` block (topologies/h100-sxm-8x.yaml has one) or drop "
           "--offload")

# Host bytes per parameter of the shard: fp32 parameters, fp32 gradients (the optimizer's state
# is the profile's or the goal's, added by the caller)
HOST_PARAM_GRAD_BYTES = 4 + 4
# Bytes one parameter costs an optimizer step on the host, in units of the node's memory bandwidth
# (an out-of-place add's, every thread streaming): torch's AdamW on CPU tensors without `fused` runs
# the per-tensor loop, a pass per elementwise op over param, grad, exp_avg and exp_avg_sq and fresh
# temporaries; fused=True one kernel. Measured by benchmarks/host_offload.py over Llama-7B-shaped
# fp32 tensors: loop 88-99 B (16-thread Xeon, 1.6B params), 139 B (2-thread AMD EPYC, 405M); fused
# 13-17 B and 18 B, and 18.6 B under FSDP2's DTensors. dlaunch's own default optimizer is fused on
# CUDA ranks (`ModelProfile.optimizer_fused`).
HOST_ADAMW_LOOP_BYTES_PER_PARAM = 100.0
HOST_ADAMW_FUSED_BYTES_PER_PARAM = 18.0
# What an offloaded step took past its price, in units of its copies' seconds over the link: on one H200 a
# 7B model's forward, backward and copies took 2.05 s (3.67 s less its host step at FSDP2's measured rate)
# where 1.51 s were priced (1.51 s of copies): 0.36. Widens the plan's interval, not its prediction.
OFFLOAD_UNPRICED_LINK_SHARE = 0.36
# fp32 bytes per parameter a gradient accumulation adds on the host (read both, write one)
HOST_ACCUMULATE_BYTES = 12.0
# bytes per parameter crossing the link: the fp32 shard in before each all-gather, the fp32
# gradient shard out after each reduce-scatter
LINK_PARAM_BYTES = 4.0
LINK_GRAD_BYTES = 4.0


def shard_params(profile: ModelProfile, strategy: Strategy, group_size: int) -> float:
    """Parameters of this rank's shard (of its TP slice)."""
    return profile.num_params / max(1, strategy.tp * group_size)


def host_bytes(profile: ModelProfile, strategy: Strategy, group_size: int, optimizer_state_bytes: float) -> float:
    """Host memory one rank's offloaded shard holds: params, grads and optimizer state."""
    return (HOST_PARAM_GRAD_BYTES + optimizer_state_bytes) * shard_params(profile, strategy, group_size)


def host_fits(host_bytes_per_rank: float, topology: Topology, headroom: float) -> bool:
    """Whether a node's ranks' offloaded state fits its host memory, `headroom` left free."""
    host = topology.host
    return host is not None and (host_bytes_per_rank * topology.devices_per_node
                                 <= host.mem_gib * GIB * (1.0 - headroom))


def steps_fused(profile: ModelProfile, topology: Topology) -> bool:
    """Whether the workload's optimizer steps in one fused kernel on this topology's ranks."""
    return profile.optimizer_fused if profile.optimizer_fused is not None else topology.device == "cuda"


def offload_s(profile: ModelProfile, strategy: Strategy, topology: Topology, group_size: int,
              fwd_s: float, bwd_s: float, grad_accum: int) -> tuple[float, float, float]:
    """(link seconds in all, of them exposed, host seconds of the optimizer step and accumulation) for
    one optimizer step of one rank. The copies in hide behind the pass they feed, backward's copies out
    after its copies in; the host's work is exposed, its bandwidth shared by the node's ranks."""
    host = topology.host
    if host is None:
        raise PlanError(NO_HOST.format(topology.name))
    local = shard_params(profile, strategy, group_size)
    link = host.link_gb_s * 1e9
    regathers = 0 if strategy.kind == "fsdp_grad_op" else 1  # grad-op keeps forward's gather
    fwd_in = LINK_PARAM_BYTES * local / link
    bwd_in, bwd_out = regathers * LINK_PARAM_BYTES * local / link, LINK_GRAD_BYTES * local / link
    total = grad_accum * (fwd_in + bwd_in + bwd_out)
    exposed = grad_accum * (max(0.0, fwd_in - fwd_s) + max(0.0, bwd_in + bwd_out - bwd_s))
    host_bw = host.mem_bw_gb_s * 1e9 / topology.devices_per_node
    step = (HOST_ADAMW_FUSED_BYTES_PER_PARAM if steps_fused(profile, topology) else HOST_ADAMW_LOOP_BYTES_PER_PARAM
            ) * optimizer_step_share(profile)
    host_s = (step + HOST_ACCUMULATE_BYTES * (grad_accum - 1)) * local / host_bw
    return total, exposed, host_s
