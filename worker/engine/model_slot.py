"""The model the engine serves: weights, KV cache, runner, tokenizer and the built step.

A new model (a reload) is loaded beside the one serving and installed only once it loaded
completely; the KV cache and the compiled step are kept when the shapes allow.

With ``--tensor-parallel-size N`` the slot holds this rank's shard: rank 0's slot starts the
followers (``tp_ranks.FollowerRanks``) and hands them each load, step build and KV resize it makes;
a follower's slot is built with the group it joined (``tp``) and starts none.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.sizing import aligned, gib
from graphkeeper.worker.engine.tp_ranks import FollowerRanks, Load, PrepareStep, RankedRunner, ResizeKV
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import LoadedModel, load_model
from graphkeeper.worker.model.presets import resolve
from graphkeeper.worker.model.sleep_memory import move_into_region
from graphkeeper.worker.model.step import CompileReport, prepare_step
from graphkeeper.worker.model.tensor_parallel import SINGLE, TensorParallel
from graphkeeper.worker.model.tokenizer import Tokenizer, load_tokenizer
from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)
L = pb.LedgerStage
#: The least bytes per token the text bound assumes: special tokens (which decoding skips) and
#: normalizers may make a token stand for more text than its decoded form shows.
MIN_TOKEN_BYTES = 16


class ModelSlot:
    def __init__(self, settings: EngineSettings, device: torch.device, ledger: Ledger,
                 metrics: WorkerMetrics, kv_blocks: int | None = None, tp: TensorParallel | None = None) -> None:
        """``kv_blocks``: the blocks the sequences share (None: a whole context per sequence).
        ``tp``: a follower rank's group; None on rank 0, which starts the followers its settings
        ask for (their processes start here, from the thread that builds the engine)."""
        self.settings = settings
        self.kv_blocks = kv_blocks
        self.device = device
        self.ledger = ledger
        self.metrics = metrics
        self.loaded: LoadedModel | None = None
        self.tokenizer: Tokenizer | None = None
        #: Every EOS the model's config and its tokenizer config declare.
        self.eos_ids: frozenset[int] = frozenset()
        #: The most bytes of text one token stands for (0 without a tokenizer): bounds text prompts.
        self.max_token_bytes = 0
        self.runner: ModelRunner | None = None
        self.optimization = resolve(settings.optimization_level, settings.compile, device.type)
        self.compile_report = CompileReport(level=self.optimization.level, reason=self.optimization.reason)
        #: Seconds the last ``load`` spent on the weights (the rest of it was the KV cache).
        self.weights_seconds = 0.0
        #: Weights and KV cache in sleepable memory (engine/sleep.py).
        self.sleepable = settings.sleep_mode and device.type == "cuda"
        #: Asleep with the rest of the process's device state in host memory (engine/context_offload.py),
        #: and the GPU's UUID the checkpoint helper reads device memory by.
        self.context_offloaded = False
        self.context_uuid = ""
        #: This rank's place in the group (SINGLE until rank 0 has joined its followers).
        self.tp = tp or SINGLE
        self.ranks = (FollowerRanks(settings, device, kv_blocks)
                      if tp is None and settings.tensor_parallel_size > 1 else None)

    def load(self, source: str, revision: str) -> tuple[LoadedModel, KVCache]:
        """New weights (and a KV cache for their shapes); nothing the engine serves is touched."""
        s = self.settings
        cache_len = aligned(s.max_seq_len)
        log.info("loading %s (%s on disk) on %s", source, describe_size(source_bytes(source)), self.device)
        started = time.perf_counter()
        if self.ranks is not None:
            self.tp = self.ranks.connect()
            self.ranks.send(Load(source, revision))
        loaded = load_model(source, device=self.device, dtype=s.dtype, max_positions=cache_len, revision=revision,
                            quantization=s.quantization, tp=self.tp)
        if self.sleepable:
            loaded.weights_region = move_into_region(loaded.model, self.device)
            torch.cuda.empty_cache()  # the weights' first home goes back before the KV cache is made
        # Settled as Ledger.restart measures after a reload: the stage is comparable across loads.
        self.ledger.record(L.LEDGER_STAGE_WEIGHTS, self.device, settle=True)
        self.weights_seconds = time.perf_counter() - started
        old = self.runner
        if old is not None and old.loaded.config == loaded.config and old.loaded.dtype == loaded.dtype:
            cache = old.cache  # same shapes: keep the allocation, only the weights move
        else:
            scratch = math.ceil(s.max_num_batched_tokens / cache_len)
            blocks = self.kv_blocks
            if blocks is None:
                blocks = s.max_num_seqs * -(-cache_len // s.kv_block_size)
            cache = KVCache(loaded.config, s.max_num_seqs, cache_len, device=self.device, dtype=loaded.dtype,
                            scratch_slots=scratch, block_size=s.kv_block_size, num_blocks=blocks,
                            sleepable=self.sleepable)
        self.ledger.record(L.LEDGER_STAGE_KV_CACHE, self.device)
        log.info("KV cache: %d blocks of %d tokens for up to %d sequences of %d tokens, %s", cache.num_blocks,
                 cache.block_size, s.max_num_seqs, cache_len, gib(cache.nbytes()))
        return loaded, cache

    @property
    def sleep_level(self) -> int:
        """The level the model sleeps at, read from its weights' region (0: awake): released with
        the weights kept in host memory is level 1, released without them level 2."""
        region = self.runner.loaded.weights_region if self.runner is not None else None
        if region is None or region.mapped:
            return 0
        return 1 if region.kept else 2

    def resize_kv(self, num_blocks: int) -> KVCache:
        """Replaces the KV cache (and the runner, whose buffers were built for it) with one of
        ``num_blocks`` blocks for the same model; the caller released every graph first (they
        were recorded against the old cache's addresses)."""
        import gc

        old = self.runner
        s = self.settings
        loaded, cache_len, scratch = old.loaded, old.cache.max_seq_len, old.cache.scratch_slots
        if self.ranks is not None:
            self.ranks.send(ResizeKV(num_blocks))
        self.runner = old = None  # the old cache's memory goes back before the new one is allocated
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        cache = KVCache(loaded.config, s.max_num_seqs, cache_len, device=self.device, dtype=loaded.dtype,
                        scratch_slots=scratch, block_size=s.kv_block_size, num_blocks=num_blocks,
                        sleepable=self.sleepable)
        self.kv_blocks = num_blocks
        self.runner = self._runner(loaded, cache)
        self.ledger.record(L.LEDGER_STAGE_KV_CACHE, self.device)
        log.info("KV cache resized: %d blocks of %d tokens, %s", num_blocks, cache.block_size, gib(cache.nbytes()))
        return cache

    def install(self, fresh: tuple[LoadedModel, KVCache]) -> bool:
        """Makes the new model the one that runs; True when it kept the old step functions (same
        config, dtype and quantization: the compiled pieces are functions of tensors and serve
        new weights)."""
        loaded, cache = fresh
        old = self.runner
        kept = old is not None and (old.loaded.config, old.loaded.dtype, old.loaded.quantization) == (
            loaded.config, loaded.dtype, loaded.quantization)
        if kept:
            loaded.model.use_pieces(old.model.pieces, old.model.kernels, old.model.row_pieces)
        self.runner = self._runner(loaded, cache)
        self.tokenizer = load_tokenizer(loaded.source)
        from_tokenizer = self.tokenizer.eos_ids() if self.tokenizer else frozenset()
        self.eos_ids = frozenset(loaded.config.eos_token_ids) | from_tokenizer
        self.max_token_bytes = longest_token_bytes(self.tokenizer, loaded.config.vocab_size)
        self.loaded = loaded  # last: whoever sees the new model sees its tokenizer and limits too
        self.metrics.set_model(loaded.revision, loaded.source, str(loaded.dtype).removeprefix("torch."),
                               str(self.device))
        log.info("model %s revision %s loaded: %d parameters, %s on %s%s", loaded.source, loaded.revision,
                 loaded.parameter_count, loaded.dtype, self.device, ", with tokenizer" if self.tokenizer else "")
        return kept

    def install_shard(self, fresh: tuple[LoadedModel, KVCache]) -> None:
        """A follower rank's install: the runner for its shard, without the tokenizer (rank 0 alone
        reads text and answers requests)."""
        loaded, cache = fresh
        self.runner = self._runner(loaded, cache)
        self.loaded = loaded

    def _runner(self, loaded: LoadedModel, cache: KVCache) -> ModelRunner:
        """The runner for ``loaded`` and ``cache``; on rank 0 of several, the facade that sends each
        step to the followers first (``tp_ranks.RankedRunner``)."""
        runner = ModelRunner(loaded, cache, self.settings.max_num_batched_tokens,
                             record_mixed=self.settings.record_mixed_attention)
        return runner if self.ranks is None else RankedRunner(runner, self.ranks)

    def prepare_step(self) -> None:
        """Builds the step (fused kernels, or compiled: traced at the largest warm-up size, or loaded
        from the on-disk cache) and runs it once, before anything is captured. Rank 0 of several
        has its followers build theirs alongside (the warm-up's collectives pair up)."""
        s, o = self.settings, self.optimization
        rows = min(max(2, min(s.max_num_seqs, s.max_num_batched_tokens)), s.max_num_batched_tokens)
        if self.ranks is not None:
            self.ranks.send(PrepareStep())
        local = getattr(self.runner, "local", self.runner)  # the followers warm up by the command above
        log.info("building the step: -O%d, %s (warm-up at %d rows)", o.level,
                 "tuning kernels and compiling" if o.compile else "eager kernels, no compilation", rows)
        self.compile_report = prepare_step(
            self.runner.model, compile=o.compile, cache_root=s.compile_cache_dir, quantization=s.quantization,
            warm_up=lambda: local.warm_up(rows), level=o.level, reason=o.reason,
            ahead=lambda: local.launches_ahead(rows))
        r = self.compile_report
        self.metrics.set_compile(o.level, r.enabled, r.cache, self.runner.model.kernels, s.quantization, r.seconds)

    def compile_status(self) -> pb.CompileStatus:
        kernels = self.runner.model.kernels if self.runner else ""
        return self.compile_report.to_proto(kernels, self.settings.quantization)


def source_bytes(source: str) -> int | None:
    """What ``source`` takes on disk (a file, or a directory's files); None for a random preset."""
    from graphkeeper.worker.model.catalog import resolve_builtin

    if source.startswith("random:"):
        return None
    try:
        path = Path(resolve_builtin(source))
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except (OSError, ValueError):
        return None


def describe_size(n: int | None) -> str:
    return "random weights" if n is None else f"{n / (1 << 20):.0f} MiB"
def longest_token_bytes(tokenizer: Tokenizer | None, vocab_size: int) -> int:
    """The most UTF-8 bytes any one token of ``tokenizer`` decodes to (at least MIN_TOKEN_BYTES).

    Measured once per load, on the engine thread while it loads anyway, so that a text prompt
    too long to fit the context is refused from its byte length without being tokenized.
    """
    if tokenizer is None:
        return 0
    longest = MIN_TOKEN_BYTES
    for token in range(vocab_size):
        try:
            longest = max(longest, len(tokenizer.decode([token]).encode("utf-8", "surrogatepass")))
        except Exception:  # noqa: BLE001 - an id the tokenizer does not know makes no text
            continue
    return longest
