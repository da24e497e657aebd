"""How long a sequence may be and how many run at once, from the model and the memory there is.

The KV cache is paged: sequences hold blocks of ``block_size`` tokens, as many as their tokens
need, and a sequence is admitted when the blocks of its prompt (and a small decode reserve) are
free (``scheduler.py``), not a whole context; it is preempted when blocks run out. So
``max_num_seqs`` bounds the sequences running at once and the blocks bound the tokens they hold
together. The cache is what ``max_seq_len`` x ``max_num_seqs`` would reserve, within the budget:
a budget smaller than that is filled with blocks, as long as one sequence of the whole context fits.

Unset, ``max_num_seqs`` is a fixed number, as vLLM's is (``DEFAULT_MAX_NUM_SEQS``: 256 on a GPU,
128 on a CPU), lowered to the token budget per step (every running sequence needs a token per
step) and to the largest batch the default capture ladder records (a larger decode batch could
never replay a graph). Unset, the context length is the model's own, capped so that the cache
still holds a few whole contexts (said in the log). Set explicitly, both are checked against the
same budget before anything is allocated: a worker asked for a KV cache the machine cannot hold
refuses at boot in one line instead of allocating until the node kills it.

``choose_sizes`` and ``default_max_num_seqs`` are pure (tests give them numbers);
``default_budget`` and ``settle`` read the machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from graphkeeper.proto.field_checks import FieldError
from graphkeeper.proto.policy import default_max_capture_size, parse_quantity

#: KV rows are allocated in multiples of this (as the attention kernels read them).
KV_ROW_ALIGN = 16
#: A random preset has no trained context: it serves this many tokens unless told otherwise.
RANDOM_PRESET_CONTEXT = 512
#: ``--max-num-seqs`` unset: vLLM's defaults for its API server (256 on a GPU, 128 on a CPU);
#: ``default_max_num_seqs`` lowers them to the step budget and the captured sizes.
DEFAULT_MAX_NUM_SEQS = {"cpu": 128, "cuda": 256}
#: A random preset keeps the fixed default it always had (tests and benchmarks rely on it), within
#: the same bounds.
RANDOM_PRESET_SEQS = 16
#: A default context is capped so that at least this many whole contexts fit in the cache.
MIN_DEFAULT_SEQS = 4
#: CPU: at most this share of the memory available to the process goes to the KV cache,
#: and never more than CPU_KV_CAP_BYTES (a CPU serves small batches).
CPU_KV_SHARE = 0.4
CPU_KV_CAP_BYTES = 2 << 30
#: GPU: the share of the device's free memory the worker may use (as vLLM's
#: gpu_memory_utilization), minus the weights and a reserve for activations and graphs.
GPU_MEMORY_SHARE = 0.9
GPU_RESERVE_BYTES = 2 << 30


class SizingError(ValueError):
    """The KV cache asked for does not fit (one line: what was asked, what it needs, what there is)."""


@dataclass(frozen=True)
class Sizes:
    max_seq_len: int
    max_num_seqs: int
    kv_cache_bytes: int
    budget_bytes: int
    #: Blocks of ``block_size`` tokens the sequences share (the scratch blocks come on top).
    kv_blocks: int
    block_size: int
    #: One line for the startup log: where each number came from.
    explanation: str


def aligned(tokens: int) -> int:
    return KV_ROW_ALIGN * math.ceil(tokens / KV_ROW_ALIGN)


def gib(n: int) -> str:
    """``n`` bytes for a log line: in GiB, or in MiB / bytes where GiB would read 0.00."""
    if n >= 10 << 20:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n} bytes"


def default_max_num_seqs(device_type: str, step_tokens: int) -> tuple[int, str]:
    """``--max-num-seqs`` when it is not set, and why (pure): the device's fixed default, at most
    the token budget per step and the largest size the default capture ladder records."""
    fixed = DEFAULT_MAX_NUM_SEQS.get(device_type, DEFAULT_MAX_NUM_SEQS["cpu"])
    top = default_max_capture_size(step_tokens)  # never above the step budget
    if fixed <= top:
        return fixed, f"the {device_type} default"
    return top, f"the {device_type} default {fixed}, lowered to the step budget and the largest captured size"


def choose_sizes(*, model_context: int, per_token_bytes: int, budget_bytes: int, max_seq_len: int | None,
                 max_num_seqs: int | None, default_seqs: tuple[int, str], step_tokens: int = 0,
                 block_size: int = 16) -> Sizes:
    """The context length, sequence count and KV blocks to serve with; raises SizingError when
    not even one sequence of the context fits.

    ``default_seqs`` is the sequence count (and where it came from) when ``max_num_seqs`` is None.
    ``step_tokens`` (the token budget of a step) sizes the cache's scratch slots, which padded
    rows write to; they count against the budget like the sequences' blocks.
    """
    why = []
    if max_num_seqs is None:
        seqs = default_seqs[0]
        why_seqs = f"{seqs} sequences ({default_seqs[1]}; admitted by blocks)"
    else:
        seqs = max_num_seqs
        why_seqs = f"{seqs} sequences (--max-num-seqs)"
    if max_seq_len is None:
        context = model_context
        wanted = min(seqs, MIN_DEFAULT_SEQS)
        fits = (budget_bytes // (per_token_bytes * (wanted + 1))) // KV_ROW_ALIGN * KV_ROW_ALIGN  # + scratch
        if fits < context:
            context = fits
            why.append(f"context {context} tokens (the model's {model_context}, capped by memory for "
                       f"{wanted} whole contexts)")
        else:
            why.append(f"context {context} tokens (the model's own)")
        if context < 2:
            raise SizingError(f"the KV cache budget ({gib(budget_bytes)}) does not hold {wanted} sequences of 2 "
                              "tokens; give the worker more memory or set --kv-cache-memory")
    else:
        context = max_seq_len
        why.append(f"context {context} tokens (--max-seq-len)")
    why.append(why_seqs)
    per_sequence = -(-aligned(context) // block_size) * block_size * per_token_bytes  # whole blocks
    scratch = max(1, math.ceil(step_tokens / aligned(context)))
    least = (1 + scratch) * per_sequence
    if least > budget_bytes:
        raise SizingError(f"--max-seq-len {context} needs {gib(least)} of KV cache for one sequence of the whole "
                          f"context; the budget is {gib(budget_bytes)} (--kv-cache-memory)")
    total = min((seqs + scratch) * per_sequence, budget_bytes)
    block_bytes = block_size * per_token_bytes
    blocks = (total - scratch * per_sequence) // block_bytes
    total = blocks * block_bytes + scratch * per_sequence
    return Sizes(context, seqs, total, budget_bytes, blocks, block_size,
                 ", ".join(why) + f": KV cache {gib(total)} ({blocks} blocks of {block_size} tokens, "
                 f"{blocks * block_size} tokens) of a {gib(budget_bytes)} budget")


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def available_host_bytes() -> int:
    """Memory this process may still use: MemAvailable, bounded by its cgroup's limit."""
    available = _meminfo_available()
    limit = _cgroup_headroom()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_headroom() -> int | None:
    """cgroup v2 ``memory.max - memory.current`` of this process's cgroup (None: unlimited)."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text().strip()))
    except (OSError, ValueError, IndexError):
        return None


def default_budget(device_type: str, weights_bytes: int, free_device_bytes: int | None = None) -> int:
    """The KV cache budget when none is set: a share of host memory on CPU (the weights come out of
    the same memory), of the device's free memory on a GPU."""
    if device_type == "cuda" and free_device_bytes is not None:
        return max(0, int(free_device_bytes * GPU_MEMORY_SHARE) - weights_bytes - GPU_RESERVE_BYTES)
    host = max(0, available_host_bytes() - weights_bytes)
    return min(CPU_KV_CAP_BYTES, int(host * CPU_KV_SHARE))


def parse_bytes(text: str) -> int:
    """``--kv-cache-memory``: a positive whole number of bytes, written as Kubernetes writes
    quantities (``2Gi``, ``1.5Gi``, ``512M``); the rule is the GraphPolicy's memoryBudget's."""
    value = parse_quantity(text.strip(), field="--kv-cache-memory")
    if value <= 0:
        raise FieldError("--kv-cache-memory", f"{text[:32]!r} must be a positive size")
    return value


def weights_bytes(config, dtype_bytes: int) -> int:
    """The decoder's weights in the serving dtype, from its config (before any are loaded)."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_layer = config.dim * (q + 2 * kv) + q * config.dim + 3 * config.dim * config.intermediate_size + 2 * config.dim
    embeddings = config.vocab_size * config.dim * (1 if config.tie_word_embeddings else 2)
    return (config.n_layers * per_layer + embeddings + config.dim) * dtype_bytes


def settle(settings, device) -> tuple[object, Sizes]:
    """``settings`` with the token budget per step (sized to the device when unset:
    ``token_budget.py``), ``max_seq_len`` and ``max_num_seqs`` decided (and checked against
    memory), and how they were decided. Reads the model's config (no weights) and the device.

    With tensor parallel ranks every figure is one rank's: its shard's weights and KV heads
    against its own device's memory (``--kv-cache-memory`` is per rank); every rank gets as many
    blocks as rank 0 decides here."""
    import dataclasses

    import torch

    from graphkeeper.worker.engine.token_budget import resolve_step_tokens
    from graphkeeper.worker.model.loader import model_dtype
    from graphkeeper.worker.model.source import read_model_config
    from graphkeeper.worker.model.tensor_parallel import shard_config

    config = shard_config(read_model_config(settings.model), settings.tensor_parallel_size)
    dtype_bytes = model_dtype(settings.model, settings.dtype, device).itemsize
    random_preset = settings.model.startswith("random:")
    context = RANDOM_PRESET_CONTEXT if random_preset else config.max_position_embeddings
    fixed_seqs = DEFAULT_MAX_NUM_SEQS.get(device.type, DEFAULT_MAX_NUM_SEQS["cpu"])
    most_seqs = RANDOM_PRESET_SEQS if random_preset else fixed_seqs
    settings = resolve_step_tokens(settings, device, context, most_seqs)
    default_seqs = default_max_num_seqs(device.type, settings.max_num_batched_tokens)
    if random_preset:
        default_seqs = (min(RANDOM_PRESET_SEQS, default_seqs[0]), "a random preset's default")
    budget = settings.kv_cache_memory
    if not budget:
        free = None
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        budget = default_budget(device.type, weights_bytes(config, dtype_bytes), free)
    sizes = choose_sizes(
        model_context=context, per_token_bytes=kv_bytes_per_token(config.n_layers, config.n_kv_heads,
                                                                  config.head_dim, dtype_bytes),
        budget_bytes=budget, max_seq_len=settings.max_seq_len, max_num_seqs=settings.max_num_seqs,
        default_seqs=default_seqs, step_tokens=settings.max_num_batched_tokens,
        block_size=settings.kv_block_size)
    return dataclasses.replace(settings, max_seq_len=sizes.max_seq_len, max_num_seqs=sizes.max_num_seqs), sizes


@dataclass(frozen=True)
class UtilizationPlan:
    """Track B's KV cache: what is left of ``utilization`` x device memory once everything else is
    measured, in blocks."""

    kv_bytes: int  # the blocks' bytes (the scratch blocks excluded)
    kv_blocks: int
    explanation: str


def check_utilization(value: float) -> float:
    """``--gpu-memory-utilization``: a fraction in (0, 1]; a ValueError naming the flag otherwise."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {value}")
    return float(value)


def utilization_error(utilization: float | None, device: str, kv_cache_memory: object) -> str | None:
    """``--gpu-memory-utilization`` (None: not given): a fraction in (0, 1], on a CUDA device,
    instead of ``--kv-cache-memory``. The one rule the CLI's boot checks and ``Engine`` both apply."""
    if utilization is None:
        return None
    try:
        check_utilization(utilization)
    except ValueError as err:
        return str(err)
    if not device.startswith("cuda"):
        return "--gpu-memory-utilization sizes the KV cache from device memory: it needs --device cuda"
    if kv_cache_memory:
        return "--gpu-memory-utilization and --kv-cache-memory both size the KV cache: give one"
    return None


def plan_kv_by_utilization(*, total_bytes: int, utilization: float, used_bytes: int, provisional_kv_bytes: int,
                           activation_peak_bytes: int, block_bytes: int, min_blocks: int) -> UtilizationPlan:
    """The KV cache's blocks under ``--gpu-memory-utilization`` (pure).

    ``used_bytes`` is the device memory in use after the weights were loaded, the step warmed up and
    the policy's graphs captured beside a provisional KV cache of ``provisional_kv_bytes`` (its
    blocks, which the final cache replaces): so the graphs' memory is measured, not estimated.
    ``activation_peak_bytes`` is the measured transient peak of the largest eager step, which must
    stay free while serving. The cache takes the rest of ``utilization`` x ``total_bytes``; raises
    SizingError when that is fewer than ``min_blocks`` (one sequence of the whole context).
    """
    check_utilization(utilization)
    allowed = int(total_bytes * utilization)
    other = used_bytes - provisional_kv_bytes
    left = allowed - other - activation_peak_bytes
    blocks = max(0, left) // block_bytes
    why = (f"{utilization:g} x {gib(total_bytes)} = {gib(allowed)}, less {gib(other)} in use besides the KV cache "
           f"(weights, graphs, context) and an activation peak of {gib(activation_peak_bytes)}")
    if blocks < min_blocks:
        need = gib(min_blocks * block_bytes)
        raise SizingError(f"--gpu-memory-utilization {utilization:g} leaves {gib(max(0, left))} for the KV cache "
                          f"({why}); one sequence of the context needs {min_blocks} blocks ({need})")
    kv = blocks * block_bytes
    return UtilizationPlan(kv, blocks, f"KV cache {blocks} blocks ({gib(kv)}): {why}")


def estimate_graph_bytes(keys: list[tuple[int, int]], measured: dict[tuple[int, int], int]) -> int:
    """Device memory that capturing ``keys`` (mode, size) would take, from measured keys (pure).

    A key captured before costs what it was measured at; another costs its size times the most
    any measured key of its mode (or, with none, of any mode) took per row: graph memory grows
    with the rows a graph records, so this errs on the side of refusing.
    """
    def per_row(entries) -> float:
        return max((b / max(1, s) for (_, s), b in entries), default=0.0)

    any_mode = per_row(measured.items())
    total = 0
    for mode, size in keys:
        if (mode, size) in measured:
            total += measured[(mode, size)]
            continue
        rate = per_row((k, b) for k, b in measured.items() if k[0] == mode) or any_mode
        total += int(rate * size)
    return total
