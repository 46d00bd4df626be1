"""The per-rank memory model, term by term, with numbers worked out by hand."""

from __future__ import annotations

import pytest

from launcher.hardware.types import DeviceSpec
from launcher.plan.activations import (
    AUTOCAST_ACTIVATION_FACTOR,
    AUTOCAST_NO_ATTENTION_FACTOR,
    COMPILE_SAVED_FACTOR,
    PARAM_DTYPE_BATCH_NORM_FACTOR,
)
from launcher.plan.checkpointing import kept_activation_bytes
from launcher.plan.memory import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFER_BYTES,
    estimate_memory,
    unsharded_root_params,
    usable_mem_bytes,
)
from launcher.specs import GIB, ModelProfile, Strategy

P = 1_000_000_000  # 1e9 params: 10 blocks of 9e7 + a 1e8-param root (embeddings, head)
ACT = 2e9  # fp32 saved activations per sample
BLOCK_IN = 1e7  # one block's input per sample


def model(num_params: int = P, **kw) -> ModelProfile:
    # a transformer (it has attention) unless `kw` says otherwise
    return ModelProfile(name="m", num_params=num_params, bytes_by_dtype={"float32": 4 * num_params},
                        num_blocks=10, largest_block_params=int(0.09 * num_params),
                        activation_bytes_per_sample=ACT, block_input_bytes_per_sample=BLOCK_IN,
                        flops_fwd_per_sample=1e12,
                        **{"attention_flops_fwd_per_sample": 1e11, **kw})


def est(kind: str = "ddp", precision: str = "fp32", *, ckpt: bool = False, mb: int = 2,
        world: int = 8, group: int = 8, device: str = "cpu", optimizer: str = "adamw",
        compile: bool = False, profile: ModelProfile | None = None):
    s = Strategy(kind=kind, precision=precision, checkpointing="full" if ckpt else "none",
                 compile=compile)
    return estimate_memory(profile or model(), s, micro_batch=mb, world_size=world,
                           shard_group_size=group, device=device, optimizer=optimizer)


def test_usable_memory_leaves_headroom():
    dev = DeviceSpec(name="g", mem_gib=80, peak_tflops={"fp32": 1})
    assert usable_mem_bytes(dev, 0.1) == pytest.approx(72 * GIB)
    assert usable_mem_bytes(dev, 0.0) == pytest.approx(80 * GIB)


def test_ddp_fp32_on_cpu_is_16_bytes_per_param_plus_activations():
    m = est("ddp", "fp32")
    assert m.params_bytes == 4e9 and m.grads_bytes == 4e9 and m.optimizer_bytes == 8e9
    assert m.activations_bytes == 2 * ACT  # fp32, measured, 2 samples
    assert m.overhead_bytes == 0  # CPU: no context; buckets are views of the grads
    assert m.total_bytes == 16e9 + 4e9
    assert "gradient_as_bucket_view" in m.assumptions


def test_ddp_bf16_on_cuda_counts_autocast_cache_context_and_slack():
    m = est("ddp", "bf16", device="cuda")
    # activations: 0.7 x 2e9 x 2 samples + autocast's bf16 weight copies 2 B x 1e9
    assert AUTOCAST_ACTIVATION_FACTOR == 0.7
    assert m.activations_bytes == pytest.approx(2.8e9 + 2e9)
    state = 16e9 + 4.8e9 + CUBLAS_WORKSPACE_BYTES
    assert m.overhead_bytes == pytest.approx(CUBLAS_WORKSPACE_BYTES + CUDA_CONTEXT_BYTES
                                             + NCCL_BUFFER_BYTES + CUDA_ALLOCATOR_SLACK * state)
    assert "cuBLAS workspaces 64 MiB" in m.assumptions
    assert "autocast weight cache 2 B/param" in m.assumptions


def test_sgd_keeps_one_momentum_buffer():
    assert est("ddp", optimizer="sgd").optimizer_bytes == 4e9


def test_fsdp_full_divides_state_and_adds_unsharded_units():
    m = est("fsdp_full", "bf16", group=8)
    assert m.params_bytes == pytest.approx(0.5e9)  # 4 B x 1e9 / 8
    assert m.grads_bytes == pytest.approx(0.5e9)
    assert m.optimizer_bytes == pytest.approx(1e9)  # 8 B x 1e9 / 8
    # root 1e8 + 2 blocks of 9e7 at 2 B = 5.6e8; one block's bf16 grads 2 x 9e7 = 1.8e8, and its fp32
    # reduce-scatter input 4 x 9e7 = 3.6e8 beyond the block's share of the activations (2e9 / 10 blocks): 1.6e8
    assert m.overhead_bytes == pytest.approx(5.6e8 + 1.8e8 + 1.6e8)
    # FSDP computes in bf16 params (no autocast, no weight cache): half the fp32 bytes
    assert m.activations_bytes == pytest.approx(0.5 * ACT * 2)
    assert "= 16 B/param / 8 (sharded)" in m.assumptions


def test_a_bf16_reduce_scatters_a_blocks_grads_as_computed():
    # test_fsdp_full_divides_state_and_adds_unsharded_units with reduce_dtype bf16: the block's grads
    # are copied into a bf16 reduce-scatter input, 2 x 9e7, which the block's 2e8 of activations hide
    s = Strategy(kind="fsdp_full", precision="bf16", reduce_dtype="bf16")
    m = estimate_memory(model(), s, micro_batch=2, world_size=8, shard_group_size=8, device="cpu")
    assert m.overhead_bytes == pytest.approx(5.6e8 + 1.8e8)
    assert "one block's bf16 grads + bf16 reduce-scatter input past its activations" in m.assumptions


def test_linear_units_gather_and_reduce_a_linear_layer_at_a_time_for_more_collectives():
    # test_fsdp_full_divides_state_and_adds_unsharded_units with each block's 4 linears units of their own, the
    # largest 3e7: root 1e8 + 2 x 3e7 at 2 B = 3.2e8, one unit's grads 6e7 and reduce-scatter input 1.2e8 beyond its
    # share of the activations (2e9 / 50 units): 8e7; 10 blocks x 5 units + the root
    from launcher.errors import UsageError
    from launcher.plan.collectives import fsdp_units

    profile = model(linear_unit_params=int(3e7), linear_units_per_block=5)
    s = Strategy(kind="fsdp_full", precision="bf16", fsdp_unit="linear")
    m = estimate_memory(profile, s, micro_batch=2, world_size=8, shard_group_size=8, device="cpu")
    assert m.overhead_bytes == pytest.approx(3.2e8 + 6e7 + 8e7)
    assert "2 linear-layer units (prefetch)" in m.assumptions
    assert (fsdp_units(profile, s), fsdp_units(profile, Strategy(kind="fsdp_full", precision="bf16"))) == (51, 11)
    for kind, kw in (("ddp", {}), ("zero1", {}), ("fsdp_full", {"tp": 2}), ("fsdp_full", {"compile": True})):
        with pytest.raises(UsageError, match="`fsdp_unit` linear shards each linear layer"):
            Strategy(kind=kind, fsdp_unit="linear", **kw)


def test_fsdp_grad_op_keeps_whole_params_at_compute_dtype():
    m = est("fsdp_grad_op", "bf16", group=8)
    assert m.params_bytes == pytest.approx(0.5e9)
    # the whole model unsharded in bf16 (2e9) + one block's bf16 grads and fp32 reduce-scatter input beyond its
    # activations (1.8e8 + 1.6e8, as full shard)
    assert m.overhead_bytes == pytest.approx(2e9 + 1.8e8 + 1.6e8)
    assert m.total_bytes > est("fsdp_full", "bf16", group=8).total_bytes


def test_hybrid_shards_inside_the_node_only():
    hybrid = est("hybrid", "bf16", world=32, group=8)
    full = est("fsdp_full", "bf16", world=32, group=32)
    assert hybrid.optimizer_bytes == pytest.approx(1e9)  # / 8, not / 32
    assert full.optimizer_bytes == pytest.approx(0.25e9)
    assert hybrid.total_bytes > full.total_bytes


def test_checkpointing_keeps_block_inputs_plus_one_block():
    m = est("ddp", "fp32", ckpt=True, mb=4)
    # 4 samples x (1e7 x 10 blocks + 2e9 / 10) = 4 x (1e8 + 2e8) = 1.2e9
    assert m.activations_bytes == pytest.approx(1.2e9)
    assert "checkpointed" in m.assumptions
    assert m.activations_bytes < est("ddp", "fp32", mb=4).activations_bytes


def test_checkpointed_inputs_stay_fp32_under_autocast_but_not_under_fsdp():
    # DDP + autocast: residual stream fp32: 2 x (1e7 x 10 + 0.7 x 2e9 / 10) = 2 x 2.4e8
    assert est("ddp", "bf16", ckpt=True).activations_bytes == pytest.approx(4.8e8 + 2e9)
    # FSDP bf16 params: everything half: 2 x (0.5e7 x 10 + 0.5 x 2e9 / 10) = 2 x 1.5e8
    assert est("fsdp_full", "bf16", ckpt=True).activations_bytes == pytest.approx(3e8)


def test_memory_grows_with_micro_batch_and_shrinks_with_shards():
    assert est(mb=4).total_bytes > est(mb=2).total_bytes
    assert est("fsdp_full", group=16, world=16).total_bytes < est("fsdp_full", group=8).total_bytes


def test_design_ground_truth_within_ten_percent():
    # a measured reference: a 3.7M-param GPT (d 256, 4 layers, seq 128) on CPU, AdamW,
    # micro-batch 2: 65.9 MB peak of new allocations vs grads 14.8 + Adam 29.6 + activations 22.5.
    # The parameters existed before the measurement began, so they are left out here.
    p = 3_700_000
    prof = ModelProfile(name="tiny", num_params=p, bytes_by_dtype={"float32": 4 * p},
                        num_blocks=4, largest_block_params=790_000,
                        activation_bytes_per_sample=11.3e6, block_input_bytes_per_sample=131_072,
                        flops_fwd_per_sample=0.94e9)
    m = estimate_memory(prof, Strategy(), micro_batch=2, world_size=1, shard_group_size=1,
                        device="cpu")
    predicted = m.total_bytes - m.params_bytes
    assert predicted == pytest.approx(65.9e6, rel=0.10)


def test_autocast_halves_a_model_without_attention_block_inputs_included():
    # a conv net or MLP: everything after the first conv / matmul is bf16 under autocast
    cnn = model(attention_flops_fwd_per_sample=0.0)
    assert AUTOCAST_NO_ATTENTION_FACTOR == 0.5
    assert est("ddp", "bf16", profile=cnn).activations_bytes == pytest.approx(0.5 * ACT * 2 + 2e9)
    # checkpointed: 2 x (0.5 x 1e7 x 10 + 0.5 x 2e9 / 10)
    assert est("ddp", "bf16", ckpt=True, profile=cnn).activations_bytes == pytest.approx(3e8 + 2e9)


def test_fsdp_bf16_behind_batch_norm_keeps_its_fp32_input_copies():
    bn = model(attention_flops_fwd_per_sample=0.0, batch_norms=20)
    assert est("fsdp_full", "bf16", profile=bn).activations_bytes == pytest.approx(
        PARAM_DTYPE_BATCH_NORM_FACTOR * ACT * 2)
    assert PARAM_DTYPE_BATCH_NORM_FACTOR == 0.75


def test_compile_saves_less_of_a_transformer_and_as_much_of_a_conv_net():
    assert est(compile=True).activations_bytes == pytest.approx(COMPILE_SAVED_FACTOR * ACT * 2)
    cnn = model(attention_flops_fwd_per_sample=0.0)
    assert est(compile=True, profile=cnn).activations_bytes == pytest.approx(ACT * 2)
    assert "compiled" in est(compile=True).assumptions


def test_fsdp_units_and_the_loss_gradient_are_counted_once():
    # the loss gradient peaks before any block's backward (every block resharded, no unsharded
    # gradient yet); the blocks' units live once it is freed: the larger of the two, not both; the
    # root (2e8 at bf16) stays gathered from forward, beside it
    small, large = 1e8, 5e9  # transient per sample: below and above the units (9e8 at bf16)
    lo = est("fsdp_full", "bf16", profile=model(backward_transient_bytes_per_sample=small))
    hi = est("fsdp_full", "bf16", profile=model(backward_transient_bytes_per_sample=large))
    units = 5.6e8 + 1.8e8 + 1.6e8
    # bf16 params: the transient at 0.5, 2 samples
    assert lo.overhead_bytes == pytest.approx(units - 0.5 * small * 2)
    assert hi.overhead_bytes == pytest.approx(2 * unsharded_root_params(model()))
    assert hi.activations_bytes == pytest.approx(0.5 * ACT * 2 + 0.5 * large * 2)
    assert "counted once" in lo.assumptions
    # grad-op keeps every unit unsharded through the loss: only its block's grads overlap
    op = est("fsdp_grad_op", "bf16", profile=model(backward_transient_bytes_per_sample=large))
    assert op.overhead_bytes == pytest.approx(2e9)


def test_cpu_attention_with_dropout_adds_the_math_path_eager_only():
    drop = model(math_attention_bytes_per_sample=1e8)
    assert est(profile=drop).activations_bytes == pytest.approx((ACT + 1e8) * 2)
    assert est(profile=drop, device="cuda").activations_bytes == pytest.approx(ACT * 2)
    assert est(profile=drop, compile=True).activations_bytes == pytest.approx(
        COMPILE_SAVED_FACTOR * ACT * 2)


def test_the_profile_counts_the_math_path_of_attention_with_dropout_only():
    import torch
    import torch.nn.functional as F

    from launcher.plan.profile_passes import MATH_ATTENTION_BYTES_PER_SCORE, _flash_like_sdpa

    q = torch.empty(2, 4, 128, 64, device="meta")
    mode = _flash_like_sdpa()
    with mode:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert mode.math_attention_bytes == 0  # flash on CPU and CUDA alike
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    # probabilities, mask and dropped probabilities per score: batch x heads x s x s
    assert mode.math_attention_bytes == MATH_ATTENTION_BYTES_PER_SCORE * 2 * 4 * 128 * 128


def test_a_fused_loss_saves_its_logits_and_one_gradient_at_the_compute_dtype():
    # a language model: two fp32 logits tensors (LOGITS each) of backward transient per sample,
    # and the eager loss's fp32 log_softmax output (LOGITS) among its saved bytes
    LOGITS = 2e8
    eager = model(backward_transient_bytes_per_sample=2 * LOGITS, sample_units="tokens")
    fused = model(backward_transient_bytes_per_sample=2 * LOGITS, sample_units="tokens",
                  loss_kernel="fused")
    # FSDP bf16, 2 samples: the log_softmax output (x0.5) out, the bf16 logits in: equal saved
    # bytes; the transient one bf16 gradient instead of two logits tensors at x0.5
    e, f = est("fsdp_full", "bf16", profile=eager), est("fsdp_full", "bf16", profile=fused)
    assert f.activations_bytes == pytest.approx(0.5 * ACT * 2 + 0.5 * LOGITS * 2)
    assert e.activations_bytes - f.activations_bytes == pytest.approx((LOGITS - 0.5 * LOGITS) * 2)
    assert "fused loss" in f.assumptions and "fused loss" not in e.assumptions
    # DDP autocast: the eager loss also saved its fp32 output at x0.7 and made 2 x 0.75 of it
    e, f = est("ddp", "bf16", profile=eager), est("ddp", "bf16", profile=fused)
    saved_eager, saved_fused = AUTOCAST_ACTIVATION_FACTOR * ACT, AUTOCAST_ACTIVATION_FACTOR * (ACT - LOGITS)
    assert e.activations_bytes - f.activations_bytes == pytest.approx(
        2 * (saved_eager + 1.5 * LOGITS - saved_fused - 0.5 * 2 * LOGITS))
    # full checkpointing drops the blocks' activations, never the loss's saved logits
    blocks = kept_activation_bytes("full", saved_bytes=0.5 * (ACT - LOGITS), block_input_bytes=0.5 * BLOCK_IN,
                                   num_blocks=10)
    ck = est("fsdp_full", "bf16", ckpt=True, profile=fused)
    assert ck.activations_bytes == pytest.approx(2 * (blocks + 0.5 * LOGITS + 0.5 * LOGITS))
    # an eager loss, or a model without logits, is unchanged by the kernel
    assert est(profile=model(loss_kernel="fused")).total_bytes == est().total_bytes
