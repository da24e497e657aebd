"""The token budget per step (``--max-num-batched-tokens``) when none is given: sized to the device.

A fixed 512 starves prefill on a large GPU (64 decoding rows leave ~450 prompt tokens a step, so a
long prompt queues for half a second) and buys nothing on a CPU, which computes a step's tokens
one core-bound matmul at a time. Like vLLM's API server, the default follows the device: 8,192
tokens on a GPU of at least 70 GiB, 2,048 on a smaller one, 512 on a CPU (the value it always
had, so CPU workers and CI run as before). The step budget (``step_budget.py``) keeps steps with
decode rows short whatever this is; only steps with no decode row take it whole.

The default is bounded by what a step can ever hold: never more than ``max_num_seqs`` sequences
of ``max_seq_len`` tokens each (every sequence's whole context in one step), with each of the two
as flagged or, unset, as defaulted before memory sizing (the device's sequence default, the
model's context): a larger budget only sizes buffers, scratch KV and graphs no step fills. And it
is never below an explicit ``--max-num-seqs`` (every running sequence needs a token a step).

It is decided in the engine core, where the device is known (``settle``); ``default_step_tokens``
is pure. An explicit ``--max-num-batched-tokens`` always wins. The API process never needs the
number: policies are judged against it by the engine, and the budget and where it came from reach
``GetModelInfo`` and ``GraphStatus`` as ``StepBudgetStatus.tokens_source``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from graphkeeper.proto.policy import PolicyError, validate_policy
from graphkeeper.worker.engine.sizing import SizingError

if TYPE_CHECKING:
    import torch

    from graphkeeper.worker.settings import EngineSettings

#: A GPU with at least this much memory gets the large default (vLLM's line: 70 GiB).
LARGE_GPU_BYTES = 70 << 30
LARGE_GPU_TOKENS = 8192
SMALL_GPU_TOKENS = 2048
#: A CPU keeps the budget it always had.
CPU_TOKENS = 512


class BudgetError(SizingError):
    """A start the budget sized to the device cannot serve (a policy file's sizes above it): the
    engine refuses to start in one line, as for a KV cache that does not fit."""


def device_tokens(device_type: str, total_bytes: int) -> tuple[int, str]:
    """The device's default and how it reads in the log: ``139 GiB cuda -> 8192``."""
    if device_type != "cuda":
        return CPU_TOKENS, f"{device_type} -> {CPU_TOKENS}"
    tokens = LARGE_GPU_TOKENS if total_bytes >= LARGE_GPU_BYTES else SMALL_GPU_TOKENS
    return tokens, f"{total_bytes / (1 << 30):.0f} GiB {device_type} -> {tokens}"


def default_step_tokens(device_type: str, total_bytes: int, max_num_seqs: int, max_seq_len: int,
                        explicit_seqs: int | None = None) -> tuple[int, str]:
    """The token budget per step when ``--max-num-batched-tokens`` is not given, and where it came
    from (pure): the device's default, at most ``max_num_seqs`` x ``max_seq_len`` (the most a step
    can hold), at least ``explicit_seqs`` (an explicit ``--max-num-seqs``)."""
    tokens, why = device_tokens(device_type, total_bytes)
    most = max(1, max_num_seqs) * max(1, max_seq_len)
    if most < tokens:
        tokens = most
        why += f", lowered to {max_num_seqs} sequences x {max_seq_len} tokens = {most}"
    if explicit_seqs is not None and explicit_seqs > tokens:
        tokens = explicit_seqs
        why += f", raised to --max-num-seqs {explicit_seqs}"
    return tokens, f"sized to the device: {why}"


def resolve_step_tokens(settings: EngineSettings, device: torch.device, model_context: int,
                        default_seqs: int) -> EngineSettings:
    """``settings`` with ``max_num_batched_tokens`` decided (explicit: kept) and its source set;
    the starting policy is judged against it here, as the CLI judges it when the budget is given.
    ``model_context`` and ``default_seqs`` bound it where ``max_seq_len``/``max_num_seqs`` are unset."""
    if settings.max_num_batched_tokens is not None:
        return settings  # explicit: the CLI judged the policy file against it already
    total = 0
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
    tokens, source = default_step_tokens(device.type, total, settings.max_num_seqs or default_seqs,
                                         settings.max_seq_len or model_context, settings.max_num_seqs)
    settings = dataclasses.replace(settings, max_num_batched_tokens=tokens, max_num_batched_tokens_source=source)
    if settings.policy is not None and settings.policy.policy_uid:
        try:
            validate_policy(settings.policy, tokens)
        except PolicyError as err:
            raise BudgetError(f"the starting policy (--policy-file): {err} ({source})") from None
    return settings
