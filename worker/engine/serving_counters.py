"""What serving produced since the last policy adoption: tokens, sequence-seconds, graph and eager
steps, padding, and inter-token latency (``GraphStatus.serving``).

The operator's canary compares a worker holding proposed capture sizes with the rest on these,
over a window it takes as the difference of two readings, so every figure is a cumulative count.
The step recorder counts each step here once; adopting a policy resets them together with the
traffic histogram, so a reading always describes one policy.

Inter-token latency is counted per sampled token as its step's seconds: in a continuously batched
decode a sequence's next token comes one step later, and the step is the quantity graphs change.
"""

from __future__ import annotations

import time

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.serving_counters import ITL_BOUNDS_SECONDS, itl_bucket


class ServingCounters:
    """Written by the engine thread only; ``to_proto`` reads plain ints and a list copy."""

    def __init__(self, now: float | None = None) -> None:
        self.reset(now)

    def reset(self, now: float | None = None) -> None:
        """Starts over: a policy was adopted."""
        self.generated_tokens = 0
        self.sequence_seconds = 0.0
        self.graph_steps = 0
        self.eager_steps = 0
        self.replayed_tokens = 0
        self.padded_tokens = 0
        self.itl_counts = [0] * (len(ITL_BOUNDS_SECONDS) + 1)
        self.since = time.time() if now is None else now

    def count(self, *, sequences: int, generated: int, seconds: float, replayed_rows: int, real_tokens: int,
              eager: bool) -> None:
        """One step: ``sequences`` ran for ``seconds`` and ``generated`` of them sampled a token;
        a replay computed ``replayed_rows`` rows for ``real_tokens`` real ones."""
        self.sequence_seconds += sequences * seconds
        self.generated_tokens += generated
        if eager:
            self.eager_steps += 1
        else:
            self.graph_steps += 1
            self.replayed_tokens += replayed_rows
            self.padded_tokens += replayed_rows - real_tokens
        if generated:
            self.itl_counts[itl_bucket(seconds)] += generated

    def to_proto(self) -> pb.ServingCounters:
        return pb.ServingCounters(
            generated_tokens=self.generated_tokens, sequence_seconds=self.sequence_seconds,
            graph_steps=self.graph_steps, eager_steps=self.eager_steps, replayed_tokens=self.replayed_tokens,
            padded_tokens=self.padded_tokens, itl_bounds_seconds=ITL_BOUNDS_SECONDS,
            itl_counts=list(self.itl_counts), since_unix_seconds=self.since)
