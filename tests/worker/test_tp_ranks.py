"""The lockstep protocol of tensor parallel ranks, in one process: a follower fed rank 0's commands
(each pickled and unpickled, as the pipe carries it) must end with rank 0's KV cache and sampled
tokens, bit for bit, after prefills, decodes, a prefix-cache hit, a batch, a drawn (not greedy)
row, and penalised rows (whose counts each rank keeps on its own device). With one rank on each
side (no collective), what is checked is that the commands carry everything a rank needs."""

from __future__ import annotations

import pickle
import threading

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.engine.tp_ranks import Follower, Load, RankedRunner, Sample, Step, WarmUp
from graphkeeper.worker.model.tensor_parallel import SINGLE

PREFIX = list(range(3, 43))


class Inline:
    """Rank 0's side of the pipes, delivering each command to the follower at once."""

    def __init__(self, follower: Follower) -> None:
        self.follower = follower
        self.sent: list = []

    def send(self, command) -> None:
        from multiprocessing.reduction import ForkingPickler

        command = pickle.loads(ForkingPickler.dumps(command))
        self.sent.append(command)
        self.follower.handle(command)


def run(engine: Engine, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    done = [threading.Event() for _ in requests]
    out: list[list[int]] = [[] for _ in requests]

    def stream(i: int):
        def take(tokens, end) -> None:
            out[i].extend(tokens)
            if end is not None:
                done[i].set()
        return take

    for i, req in enumerate(requests):
        engine.submit(req, stream(i))
    assert all(d.wait(120) for d in done)
    return out


def request(prompt: list[int], penalty: float = 1.0, temperature: float = 0.0) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt,
                              sampling=pb.SamplingParams(repetition_penalty=penalty, temperature=temperature),
                              stopping=pb.StoppingCriteria(max_new_tokens=10, ignore_eos=True))


def test_a_follower_fed_rank_0s_commands_holds_rank_0s_kv_cache_and_tokens():
    engine = Engine(EngineSettings(model="random:tiny", dtype="float32", max_num_seqs=4, max_seq_len=128,
                                   max_num_batched_tokens=64))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.failed is None
        follower = Follower(engine.settings, torch.device("cpu"), SINGLE, engine.slot.kv_blocks)
        ranks = Inline(follower)
        ranks.send(Load(engine.settings.model, ""))
        ranks.send(WarmUp(4, None))
        local = engine.slot.runner
        engine.slot.runner = RankedRunner(local, ranks)  # the engine is idle: no step holds the old one
        run(engine, [request(PREFIX + [50, 51])])
        run(engine, [request(PREFIX + [60]), request([7, 8, 9], penalty=1.3), request(PREFIX[:18] + [2], 1.1),
                     request([20, 21], temperature=1.0)])  # drawn: the seed travels in the plan
        assert engine.status().kv_cache.prefix_hit_tokens >= 32
        mine = follower.slot.runner
        assert torch.equal(mine.cache.k, local.cache.k) and torch.equal(mine.cache.v, local.cache.v)
        assert torch.equal(mine.last_tokens, local.last_tokens)
        assert torch.equal(mine.cache.block_table, local.cache.block_table)
        steps = [c for c in ranks.sent if isinstance(c, Step | Sample)]
        assert steps and all(isinstance(a, Step) and isinstance(b, Sample) for a, b in zip(steps[::2], steps[1::2],
                                                                                          strict=True))
        # Penalised rows' processing travels in the plan; each rank keeps the counts on its device.
        assert any(c.plan.logits is not None and len(c.plan.logits.penalised) for c in steps if isinstance(c, Step))
        assert local.penalties.counts.sum() > 0
        assert torch.equal(mine.penalties.counts, local.penalties.counts)
        assert torch.equal(mine.penalties.prompt, local.penalties.prompt)
    finally:
        engine.drain_and_stop(5)
