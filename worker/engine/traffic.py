"""The worker's traffic: a bounded histogram of step shapes since the last policy adoption.

Traffic-chosen capture sizes are chosen from what steps actually looked like: how many real
tokens each step carried, how many sequences, and whether it was a uniform decode step (every
sequence one token, what FULL graphs serve) or a mixed one (prefill chunks, what PIECEWISE
graphs serve). The step recorder counts every step here once, after it ran; ``GraphStatus.traffic``
exports the table, and the operator merges the tables of the workers a policy selects.

The table is bounded: at most ``max_shapes`` distinct shapes are kept (a shape is at most
``max_num_batched_tokens x max_num_seqs x 2``, which can be millions); a step whose shape finds no
room is counted in ``overflow_steps`` only, so ``steps`` always counts every step. Adopting a
policy resets the table and stamps it with that policy's uid and generation, so a histogram
always describes traffic served under one policy.

A pure data structure: no torch, no device, testable anywhere.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from graphkeeper.proto import worker_pb2 as pb

#: Distinct step shapes kept; the proto table stays well under 100 KiB.
MAX_SHAPES = 4096


class Shape(NamedTuple):
    num_tokens: int  # real (unpadded) tokens
    num_seqs: int
    uniform_decode: bool


class TrafficHistogram:
    """Steps per shape since ``since`` (a Unix time), under the policy ``policy_uid``/``policy_generation``.

    Written by the engine thread only; read by any thread through ``to_proto``/``tokens``, which
    copy the table first (a dict copy is one atomic operation under the GIL, iteration is not).
    """

    def __init__(self, max_shapes: int = MAX_SHAPES, now: float | None = None) -> None:
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be at least 1, got {max_shapes}")
        self.max_shapes = max_shapes
        self._counts: dict[Shape, int] = {}
        self.steps = 0
        self.overflow_steps = 0
        self.since = time.time() if now is None else now
        self.policy_uid = ""
        self.policy_generation = 0

    def count(self, num_tokens: int, num_seqs: int, uniform_decode: bool) -> bool:
        """Counts one step; False when its shape found no room in the table (counted as overflow)."""
        self.steps += 1
        shape = Shape(num_tokens, num_seqs, uniform_decode)
        held = self._counts.get(shape)
        if held is not None:
            self._counts[shape] = held + 1
            return True
        if len(self._counts) >= self.max_shapes:
            self.overflow_steps += 1
            return False
        self._counts[shape] = 1
        return True

    def reset(self, policy_uid: str, policy_generation: int, now: float | None = None) -> None:
        """Starts over: a policy was adopted, and what follows is traffic served under it."""
        self._counts = {}
        self.steps = 0
        self.overflow_steps = 0
        self.since = time.time() if now is None else now
        self.policy_uid = policy_uid
        self.policy_generation = policy_generation

    def shapes(self) -> dict[Shape, int]:
        """A copy of the table."""
        return dict(self._counts)

    def tokens(self) -> dict[tuple[int, bool], int]:
        """Steps per (real tokens, uniform decode): what a step pads by, whatever its sequence count."""
        out: dict[tuple[int, bool], int] = {}
        for shape, steps in self.shapes().items():
            key = (shape.num_tokens, shape.uniform_decode)
            out[key] = out.get(key, 0) + steps
        return out

    def to_proto(self) -> pb.StepHistogram:
        """The table, ordered by (tokens, sequences, decode first), as ``GraphStatus.traffic``."""
        shapes = sorted(self.shapes().items(), key=lambda kv: (kv[0].num_tokens, kv[0].num_seqs,
                                                               not kv[0].uniform_decode))
        return pb.StepHistogram(
            shapes=[pb.StepShape(num_tokens=s.num_tokens, num_seqs=s.num_seqs, uniform_decode=s.uniform_decode,
                                 steps=n) for s, n in shapes],
            steps=self.steps, overflow_steps=self.overflow_steps, since_unix_seconds=self.since,
            policy_uid=self.policy_uid, policy_generation=self.policy_generation)
