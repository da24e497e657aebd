"""The token budget per step sized to the device when ``--max-num-batched-tokens`` is not given:
the rule (pure), its bounds, the engine's resolution (an explicit value wins; a starting policy is
judged against what it resolved to), the flag's spelling, and a real CPU worker saying where its
budget came from."""

from __future__ import annotations

import argparse

import pytest
import torch

from graphkeeper.cli import _tokens_or_auto
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import policy_to_json
from graphkeeper.worker.engine.token_budget import (
    CPU_TOKENS,
    BudgetError,
    default_step_tokens,
    resolve_step_tokens,
)
from graphkeeper.worker.main import limit_errors, read_policy_file
from graphkeeper.worker.settings import EngineSettings

GIB = 1 << 30
H200 = 139 * GIB  # what torch reports for an H200's total memory, rounded


@pytest.mark.parametrize(("device", "total", "tokens", "why"), [
    ("cuda", H200, 8192, "139 GiB cuda -> 8192"),
    ("cuda", 70 * GIB, 8192, "70 GiB cuda -> 8192"),  # vLLM's line: 70 GiB and more is a large GPU
    ("cuda", 70 * GIB - 1, 2048, "70 GiB cuda -> 2048"),
    ("cuda", 24 * GIB, 2048, "24 GiB cuda -> 2048"),
    ("cpu", 0, 512, "cpu -> 512"),  # a CPU keeps the budget it always had
])
def test_the_default_follows_the_device(device, total, tokens, why):
    assert default_step_tokens(device, total, max_num_seqs=256, max_seq_len=4096) == (
        tokens, f"sized to the device: {why}")


def test_the_default_never_exceeds_what_a_step_can_hold_and_never_falls_below_explicit_sequences():
    # 4 sequences of 128 tokens: no step ever holds more than 512 tokens.
    assert default_step_tokens("cuda", H200, max_num_seqs=4, max_seq_len=128) == (
        512, "sized to the device: 139 GiB cuda -> 8192, lowered to 4 sequences x 128 tokens = 512")
    # A random preset's defaults (16 sequences of 512 tokens) allow the whole 8,192.
    assert default_step_tokens("cuda", H200, max_num_seqs=16, max_seq_len=512)[0] == 8192
    # Every running sequence needs a token a step: an explicit --max-num-seqs above the default wins.
    assert default_step_tokens("cpu", 0, max_num_seqs=1024, max_seq_len=2048, explicit_seqs=1024) == (
        1024, "sized to the device: cpu -> 512, raised to --max-num-seqs 1024")


def test_an_explicit_budget_wins_and_auto_resolves_on_the_cpu_to_todays_value():
    cpu = torch.device("cpu")
    explicit = EngineSettings(max_num_batched_tokens=96)
    assert resolve_step_tokens(explicit, cpu, 2048, 128) is explicit
    resolved = resolve_step_tokens(EngineSettings(), cpu, 2048, 128)
    assert resolved.max_num_batched_tokens == CPU_TOKENS == 512
    assert resolved.max_num_batched_tokens_source == "sized to the device: cpu -> 512"
    bounded = resolve_step_tokens(EngineSettings(max_num_seqs=2, max_seq_len=64), cpu, 2048, 128)
    assert bounded.max_num_batched_tokens == 128


def test_a_starting_policy_is_judged_against_the_budget_once_it_is_resolved(tmp_path):
    policy = pb.GraphPolicy(policy_uid="u", generation=1,
                            capture_sizes=pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[8, 1024])))
    file = tmp_path / "policy.json"
    file.write_text(policy_to_json(policy))
    # The CLI cannot judge the sizes before the device is known: the file reads as valid with the
    # budget unset, and as too large against an explicit one.
    assert read_policy_file(str(file), None) == (policy, None)
    assert "1024 exceeds this worker's token budget per step (512)" in read_policy_file(str(file), 512)[1]
    with pytest.raises(BudgetError, match=r"sizes\[1\]: 1024 exceeds this worker's token budget per step \(512\)"):
        resolve_step_tokens(EngineSettings(policy=policy), torch.device("cpu"), 2048, 128)
    fits = pb.GraphPolicy(policy_uid="u", generation=1,
                          capture_sizes=pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=[8, 512])))
    assert resolve_step_tokens(EngineSettings(policy=fits), torch.device("cpu"), 2048, 128).policy is fits


def test_the_flag_reads_auto_or_a_number_and_the_boot_checks_leave_auto_to_the_engine():
    assert _tokens_or_auto("auto") is None and _tokens_or_auto("AUTO") is None
    assert _tokens_or_auto("2048") == 2048
    with pytest.raises(argparse.ArgumentTypeError, match="neither a whole number nor auto"):
        _tokens_or_auto("lots")
    assert limit_errors(1024, None, None, 16) == []  # auto: raised to the sequences by the engine
    assert limit_errors(8, None, 4, 16)[0].startswith("--max-num-batched-tokens (4) must be at least")


def test_a_cpu_worker_says_its_budget_was_sized_to_the_device(module_workers):
    worker = module_workers("--max-num-seqs", "4", "--max-seq-len", "256")
    for b in (worker.status().step_budget, worker.model_info().step_budget):
        assert b.tokens == 512 and b.tokens_source == "sized to the device: cpu -> 512"
    assert "step budget: 512 tokens a step (sized to the device: cpu -> 512; no step times measured" in worker.log()


def test_graphkeeper_status_says_where_the_budget_came_from():
    from graphkeeper.client import step_budget_line

    fixed = pb.StepBudgetStatus(tokens=512, tokens_with_decode=512, source="no step times measured",
                                tokens_source="sized to the device: cpu -> 512")
    assert step_budget_line(fixed) == (
        "budget    512 tokens a step (sized to the device: cpu -> 512) (no step times measured)")
    targeted = pb.StepBudgetStatus(tokens=8192, tokens_with_decode=512, itl_target_seconds=0.0048,
                                   source="derived: a 512-token step",
                                   tokens_source="sized to the device: 139 GiB cuda -> 8192")
    assert step_budget_line(targeted) == (
        "budget    8192 tokens a step with no decode row (sized to the device: 139 GiB cuda -> 8192), 512 with "
        "decode rows (inter-token target 4.80 ms: derived: a 512-token step)")
