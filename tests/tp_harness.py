"""Tensor-parallel ranks as real processes, for the CPU (Gloo) and GPU (NCCL) tests: each rank
joins the process group, loads its shard, runs the same steps through a ``ModelRunner`` with a
paged KV cache and writes what it computed; the test compares the ranks with one process
holding the whole model.

The steps (``scenario``) are what an engine's step plans look like: one batched prefill of three
prompts of different lengths, whose blocks are handed out as the positions need them; then a
mixed step, the three decoding beside the prefill of a fourth prompt that shares the first
prompt's first two blocks (a prefix-cache hit: only the rest of it is computed); then greedy
decode steps of all four. Every rank is given the same plans, as rank 0's engine would hand them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.model.kv_cache import KVCache
from graphkeeper.worker.model.loader import LoadedModel, load_model
from graphkeeper.worker.model.step import compile_counters
from graphkeeper.worker.model.tensor_parallel import end_rank, first_ranks, init_tensor_parallel
from graphkeeper.worker.plan import PrefillChunk, StepPlan

MAX_LEN = 128
BLOCK = 16
SLOTS = 4
MAX_TOKENS = 64
DECODE_STEPS = 6
_rng = np.random.default_rng(39)
PROMPTS = [_rng.integers(3, 500, n).tolist() for n in (37, 5, 20)]
#: Shares the first prompt's first 32 tokens, its first two blocks: only the rest is prefilled.
SHARED = 2 * BLOCK
PREFIX_HIT = PROMPTS[0][:SHARED] + _rng.integers(3, 500, 9).tolist()

#: A step: runs ``plan`` and returns the hidden states of its rows.
Step = Callable[[ModelRunner, StepPlan], torch.Tensor]


def eager_step(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    return runner.forward_eager(runner.prepare(plan, plan.num_tokens), plan.num_tokens)


@dataclass
class Blocks:
    """Hands out KV blocks to slots as their positions need them, as the engine's block table does."""

    tables: dict[int, list[int]] = field(default_factory=dict)
    next_block: int = 0

    def cover(self, slot: int, positions: int, updates: list[tuple[int, int, int]]) -> None:
        table = self.tables.setdefault(slot, [])
        while len(table) * BLOCK < positions:
            updates.append((slot, len(table), self.next_block))
            table.append(self.next_block)
            self.next_block += 1

    def share(self, slot: int, source: int, blocks: int, updates: list[tuple[int, int, int]]) -> None:
        """``slot`` starts on ``source``'s first ``blocks`` blocks (a prefix-cache hit)."""
        self.tables[slot] = list(self.tables[source][:blocks])
        updates.extend((slot, i, b) for i, b in enumerate(self.tables[slot]))


def plan_for(decode: list[tuple[int, int, int]], chunks: list[tuple[int, list[int], int]],
             updates: list[tuple[int, int, int]]) -> StepPlan:
    """Decode rows (slot, position, token) first, then prefill chunks (slot, tokens, start)."""
    tokens, positions, slots, sample_rows, prefill = [], [], [], [], []
    for i, (slot, position, token) in enumerate(decode):
        tokens.append(token), positions.append(position), slots.append(slot), sample_rows.append(i)
    for slot, chunk, start in chunks:
        row = len(tokens)
        prefill.append(PrefillChunk(row, len(chunk), slot, start))
        tokens += chunk
        positions += range(start, start + len(chunk))
        slots += [slot] * len(chunk)
        sample_rows.append(len(tokens) - 1)
    nd = len(decode)
    slots_a, rows_a = np.array(slots, dtype=np.int64), np.array(sample_rows, dtype=np.int64)
    return StepPlan(prompt_tokens=tokens[nd:], positions=np.array(positions, dtype=np.int64), slots=slots_a,
                    num_decode=nd, prefill=prefill, sample_rows=rows_a, sample_slots=slots_a[rows_a],
                    decode_tokens=np.array(tokens[:nd], dtype=np.int64),
                    block_updates=np.array(updates, dtype=np.int64).T.reshape(3, -1))


def scenario(runner: ModelRunner, step: Step = eager_step) -> dict:
    """Runs the steps; returns each step's greedy tokens (by slot) and float32 logits (on the CPU)."""
    blocks = Blocks()
    lengths: dict[int, int] = {}
    out: dict = {"tokens": [], "logits": []}

    def run(plan: StepPlan, sampled_slots: list[int]) -> dict[int, int]:
        hidden = step(runner, plan)
        logits = runner.model.logits(runner.sample_rows(hidden, plan))
        chosen = logits.argmax(-1).tolist()
        out["tokens"].append(chosen)
        out["logits"].append(logits.cpu())
        return dict(zip(sampled_slots, chosen, strict=True))

    updates: list[tuple[int, int, int]] = []
    for slot, prompt in enumerate(PROMPTS):
        blocks.cover(slot, len(prompt), updates)
        lengths[slot] = len(prompt)
    last = run(plan_for([], [(s, p, 0) for s, p in enumerate(PROMPTS)], updates), list(range(len(PROMPTS))))

    updates = []
    blocks.share(3, 0, SHARED // BLOCK, updates)
    blocks.cover(3, len(PREFIX_HIT), updates)
    decode = []
    for slot in range(len(PROMPTS)):
        blocks.cover(slot, lengths[slot] + 1, updates)
        decode.append((slot, lengths[slot], last[slot]))
        lengths[slot] += 1
    lengths[3] = len(PREFIX_HIT)
    last = run(plan_for(decode, [(3, PREFIX_HIT[SHARED:], SHARED)], updates), [0, 1, 2, 3])

    for _ in range(DECODE_STEPS):
        updates, decode = [], []
        for slot in range(SLOTS):
            blocks.cover(slot, lengths[slot] + 1, updates)
            decode.append((slot, lengths[slot], last[slot]))
            lengths[slot] += 1
        last = run(plan_for(decode, [], updates), list(range(SLOTS)))
    return out


def make_runner(loaded: LoadedModel) -> ModelRunner:
    """A runner over a paged KV cache sized by the loaded model's config: this rank's heads."""
    cache = KVCache(loaded.config, SLOTS, MAX_LEN, device=loaded.device, dtype=loaded.dtype, block_size=BLOCK,
                    num_blocks=32)
    return ModelRunner(loaded, cache, max_tokens=MAX_TOKENS)


#: Prepares a runner before the scenario (compiles, captures) and returns its step.
Setup = Callable[[ModelRunner], Step]


def eager_setup(runner: ModelRunner) -> Step:
    return eager_step


def traced_setup(runner: ModelRunner) -> Step:
    """The pieces compiled as the worker compiles them (``step.compile_pieces``: a dynamic batch
    dimension, ``fullgraph=True``), the all-reduce traced into them, through ``aot_eager``: Dynamo
    and AOTAutograd as on the GPU, no code generated (the GPU test runs Inductor's)."""
    from graphkeeper.worker.model.llama import make_pieces
    from graphkeeper.worker.model.step import compile_pieces

    model = runner.model
    model.use_pieces(compile_pieces(make_pieces(model.config, tp=model.tp), backend="aot_eager"), "aot_eager")
    return eager_step


def single(source: str, device: str, setup: Setup = eager_setup, quantization: str = "none") -> dict:
    """The scenario on one process holding the whole model (no torch.distributed)."""
    loaded = load_model(source, device=device, dtype="float32", max_positions=MAX_LEN, quantization=quantization)
    with torch.inference_mode():
        runner = make_runner(loaded)
        return scenario(runner, setup(runner))


def rank_main(rank: int, size: int, init_method: str, source: str, device: str, out_dir: str,
              setup: Setup = eager_setup, quantization: str = "none") -> None:
    """One rank: joins the group, loads its shard, runs the scenario, writes ``rank<r>.pt``."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tp = init_tensor_parallel(rank, size, init_method, device, timeout_s=60)
    loaded = load_model(source, device=device, dtype="float32", max_positions=MAX_LEN, tp=tp,
                        quantization=quantization)
    with torch.inference_mode():
        runner = make_runner(loaded)
        result = scenario(runner, setup(runner))
    result["heads"] = (loaded.config.n_heads, loaded.config.n_kv_heads, loaded.config.intermediate_size)
    result["kv_cache_shape"] = tuple(runner.cache.k.shape)
    result["agreed"] = first_ranks(f"rank {rank}'s choice", tp)
    result["compiled_graphs"] = compile_counters()["graphs"]
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_rank(tp)  # a failure above raises instead: no barrier, the process's own exit code


def run_ranks(size: int, source: str, device: str, out_dir: Path, setup: Setup = eager_setup,
              timeout_s: float = 300, quantization: str = "none") -> list[dict]:
    """Starts ``size`` rank processes (spawned: fresh interpreters, as a worker's ranks are) and
    returns what each wrote; a rank that raises fails the call with its traceback, and ranks
    still running after ``timeout_s`` are killed and fail it."""
    import torch.multiprocessing as mp

    # A file rendezvous, not a TCP port: a port found free may be taken by another test's
    # process before rank 0 binds it (Gloo's own connections bind ports the kernel picks).
    init_method = f"file://{out_dir / 'rendezvous'}"
    args = (size, init_method, source, device, str(out_dir), setup, quantization)
    context = mp.start_processes(rank_main, args=args,
                                 nprocs=size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"tensor-parallel ranks still running after {timeout_s} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]
