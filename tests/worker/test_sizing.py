"""How long a sequence may be and how many run at once (engine/sizing.py): pure decisions."""

from __future__ import annotations

import pytest

from graphkeeper.worker.engine.sizing import (
    SizingError,
    check_utilization,
    choose_sizes,
    default_max_num_seqs,
    estimate_graph_bytes,
    kv_bytes_per_token,
    parse_bytes,
    plan_kv_by_utilization,
)

GIB = 1 << 30
PER_TOKEN = kv_bytes_per_token(30, 3, 64, 4)  # SmolLM2-135M in float32: 46,080 bytes


def sizes(**kw):
    args = dict(model_context=8192, per_token_bytes=PER_TOKEN, budget_bytes=4 * GIB, max_seq_len=None,
                max_num_seqs=None, default_seqs=(128, "the cpu default"))
    return choose_sizes(**(args | kw))


def test_unset_the_context_is_the_models_and_the_sequences_a_fixed_default_admitted_by_blocks():
    """128 sequences of 8,192 tokens would take 46 GiB: the 4 GiB budget becomes blocks, and the
    sequences are admitted by the blocks their prompts need, not by whole contexts."""
    s = sizes()
    assert s.max_seq_len == 8192 and s.max_num_seqs == 128
    assert s.kv_blocks == (4 * GIB - 8192 * PER_TOKEN) // (16 * PER_TOKEN)  # one scratch context, then blocks
    assert "the model's own" in s.explanation and "128 sequences (the cpu default; admitted by blocks)" in s.explanation


def test_a_small_budget_caps_the_context_to_a_few_whole_contexts_and_says_so():
    s = sizes(budget_bytes=GIB)
    assert s.max_seq_len < 8192 and s.max_seq_len % 16 == 0 and s.max_num_seqs == 128
    assert s.kv_blocks * 16 >= 4 * s.max_seq_len  # four whole contexts still fit
    assert "capped by memory for 4 whole contexts" in s.explanation


@pytest.mark.parametrize("device,step_tokens,expected", [
    ("cuda", 512, 256), ("cpu", 512, 128), ("cuda", 8192, 256),  # the fixed defaults, as vLLM's API server
    ("cuda", 64, 64), ("cpu", 100, 100),  # never above the step budget (a token per sequence per step)
])
def test_the_default_sequence_count_is_fixed_per_device_and_bounded_by_the_step_and_the_ladder(
        device, step_tokens, expected):
    seqs, why = default_max_num_seqs(device, step_tokens)
    assert seqs == expected and device in why
    assert ("lowered" in why) == (expected < {"cuda": 256, "cpu": 128}[device])


def test_the_default_is_what_the_default_ladder_can_replay():
    from graphkeeper.proto.policy import default_ladder, default_max_capture_size

    for device in ("cpu", "cuda"):
        for step in (1, 8, 96, 512, 4096):
            seqs, _ = default_max_num_seqs(device, step)
            assert 1 <= seqs <= default_ladder(default_max_capture_size(step))[-1] <= step


def test_explicit_sizes_that_do_not_fit_are_refused_in_one_line():
    with pytest.raises(SizingError) as err:
        sizes(max_seq_len=100_000_000, max_num_seqs=16)
    assert "--max-seq-len 100000000 needs" in str(err.value) and "one sequence" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(SizingError):
        sizes(max_seq_len=100_000_000)


def test_the_scratch_slots_count_against_the_budget():
    s = sizes(max_seq_len=1024, max_num_seqs=4, step_tokens=4096)
    assert s.kv_cache_bytes == (4 + 4) * 1024 * PER_TOKEN and s.kv_blocks == 4 * 1024 // 16
    with pytest.raises(SizingError):
        sizes(max_seq_len=1024, max_num_seqs=4, step_tokens=4096, budget_bytes=5 * 1024 * PER_TOKEN - 1)


def test_a_budget_below_the_static_reservation_is_filled_with_blocks():
    """Paged: 256 sequences of a 8192-token context need not fit at once; the budget becomes blocks
    (after the scratch slots), sequences are admitted while blocks remain."""
    s = sizes(max_seq_len=8192, max_num_seqs=256, budget_bytes=4 * GIB, block_size=32)
    assert s.max_num_seqs == 256 and s.block_size == 32
    assert s.kv_blocks == (4 * GIB - 8192 * PER_TOKEN) // (32 * PER_TOKEN)
    assert s.kv_cache_bytes <= 4 * GIB and "blocks of 32 tokens" in s.explanation


def test_explicit_sizes_that_fit_are_kept():
    s = sizes(max_seq_len=512, max_num_seqs=8)
    assert (s.max_seq_len, s.max_num_seqs) == (512, 8)


@pytest.mark.parametrize("text,value", [("4Gi", 4 * GIB), ("512Mi", 512 << 20), ("1G", 10**9), ("1000", 1000),
                                        ("1.5Gi", 3 * GIB // 2)])
def test_sizes_parse_as_kubernetes_writes_them(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "x", "-1Gi", "0", "inf", "1e30Gi"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_track_b_gives_the_cache_what_is_left_after_everything_measured():
    """80 GiB at 0.9 is 72 GiB; 20 GiB is in use beside a provisional 1 GiB of blocks (weights,
    graphs, scratch), 3 GiB is the activation peak: 50 GiB of 2 MiB blocks."""
    plan = plan_kv_by_utilization(total_bytes=80 * GIB, utilization=0.9, used_bytes=21 * GIB,
                                  provisional_kv_bytes=GIB, activation_peak_bytes=3 * GIB,
                                  block_bytes=2 << 20, min_blocks=512)
    expected = (int(80 * GIB * 0.9) - 20 * GIB - 3 * GIB) // (2 << 20)
    assert plan.kv_blocks == expected and plan.kv_bytes == expected * (2 << 20)
    assert "activation peak of 3.00 GiB" in plan.explanation


def test_track_b_refuses_when_not_one_context_fits():
    with pytest.raises(SizingError) as err:
        plan_kv_by_utilization(total_bytes=80 * GIB, utilization=0.25, used_bytes=21 * GIB, provisional_kv_bytes=GIB,
                               activation_peak_bytes=3 * GIB, block_bytes=2 << 20, min_blocks=512)
    assert "--gpu-memory-utilization 0.25 leaves 0 bytes" in str(err.value) and "512 blocks" in str(err.value)


@pytest.mark.parametrize("value", [0, -0.1, 1.01, float("nan"), float("inf")])
def test_a_utilization_outside_zero_to_one_is_refused(value):
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be a fraction in"):
        check_utilization(value)
    assert check_utilization(1) == 1.0 and check_utilization(0.05) == 0.05


def test_graph_memory_of_a_new_ladder_is_estimated_from_what_was_measured():
    """Captured keys cost what they were measured at; others their size times the largest per-row
    cost of their mode (or any mode): the estimate a track B worker refuses a policy by."""
    measured = {(3, 8): 800, (3, 16): 1200, (2, 64): 6400}
    assert estimate_graph_bytes([(3, 8), (3, 16)], measured) == 2000
    assert estimate_graph_bytes([(3, 32)], measured) == 32 * 100  # 100 B a row, from size 8
    assert estimate_graph_bytes([(4, 10)], measured) == 10 * 100  # no FULL_DECODE_ONLY measured: any mode's
    assert estimate_graph_bytes([(3, 8)], {}) == 0
