"""The published-results benchmark plans its rows as `dlaunch plan` does: the real command, given the
row's settings as flags (strategy, micro-batch, checkpointing, kernels, reduce dtype, float8),
prices the row exactly as the benchmark's in-process path. An H100 row checks the flags a user on
that GPU must give to match what the source ran: the plan picks float8 there unless told
`--float8 none`, and reduces in fp32 unless told `--reduce-dtype bf16`."""

from tests.helpers import published_runner


def test_an_h100_row_plans_through_the_command_as_in_the_benchmark():
    run = published_runner()
    row = next(r for r in run.load_rows() if r["id"] == "llmfoundry-mpt7b-h100-sxm-s2048-g8")
    assert row["reduce_dtype"] == "bf16" and row.get("float8", "none") == "none"
    said = run.cli_check(row)
    assert ": identical;" in said, said
    assert "attention triton-fa (given)" in said and "loss fused (given)" in said, said
