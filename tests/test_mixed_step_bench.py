"""The mixed steps the attention and mixed-step benches time (their figures need a GPU): every row
of the padded step covered once, decode rows as one-row blocks, prompts cut as the runner cuts
them, and kernels sorted into the kinds the breakdown reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from attention_kernel_bench import mixed_work  # noqa: E402
from mixed_step_bench import kind_of, mixed_plan  # noqa: E402

from graphkeeper.worker.kernels.varlen_kernel import BLOCK_Q  # noqa: E402


def test_a_mixed_work_list_covers_each_row_once_in_the_runner_s_order():
    """The chunks' blocks first, then one block per decode row from the longest context down, as
    the runner lists them (the attention bench times the launch the step makes)."""
    args = argparse.Namespace(length=656, chunk=48)
    work = mixed_work(60, 68, 128, args)
    blocks = work["blocks"]
    rows = sorted(r for first, n, _, _ in blocks for r in range(first, first + n))
    assert rows == list(range(128))
    chunks, decode = blocks[:len(blocks) - 60], blocks[-60:]
    assert all(1 <= n <= BLOCK_Q for _, n, _, _ in chunks) and min(first for first, *_ in chunks) == 60
    assert [n for _, n, _, _ in decode] == [1] * 60 and sorted(first for first, *_ in decode) == list(range(60))
    depths = [pos for *_, pos in decode]
    assert depths == sorted(depths, reverse=True)
    plan = mixed_plan(60, 68, 656, 48, vocab=4, seed=60 * 1000 + 68)
    assert [(slot, pos) for first, _, slot, pos in decode] == [
        (int(plan.slots[first]), int(plan.positions[first])) for first, *_ in decode]
    assert work["keys"] == int(plan.positions[:60].sum()) + 60 + sum(pos + n for _, n, _, pos in chunks)
    assert work["slots"] == 62  # 60 decode rows, then chunks of 48 and 20
    assert mixed_work(60, 68, 128, args) == work  # the same case draws the same list


def test_a_mixed_plan_puts_decode_rows_first_and_chunks_at_consecutive_positions():
    plan = mixed_plan(52, 76, depth=656, chunk=48, vocab=1000, seed=1)
    assert plan.num_tokens == 128 and plan.num_decode == 52
    assert [(c.row, c.length) for c in plan.prefill] == [(52, 48), (100, 28)]
    for chunk in plan.prefill:
        span = plan.positions[chunk.row:chunk.row + chunk.length]
        assert np.array_equal(span, np.arange(chunk.start, chunk.start + chunk.length))
        assert set(plan.slots[chunk.row:chunk.row + chunk.length]) == {chunk.slot}
    assert (plan.positions[:52] < 656).all() and len(set(plan.slots[:52])) == 52
    assert list(plan.sample_rows[-2:]) == [99, 127]  # each chunk's last row samples


def test_kernels_are_sorted_by_kind():
    assert kind_of("_varlen_kernel") == "attention"
    assert kind_of("triton_poi_fused_add_rms_norm_3") == "norms"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "projections"
    assert kind_of("_row_kernel") == "projections"
    assert kind_of("_kv_write_kernel") == "kv write"
    assert kind_of("triton_poi_fused_mul_silu_1") == "other"
