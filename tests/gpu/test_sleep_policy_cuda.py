"""The policy's sleep settings on a real GPU worker with graphs: changing only them is adopted
without a recapture (the same graphs keep serving). Run with ``pytest -m cuda``."""

from __future__ import annotations

import pytest
import torch
from test_graph_economics_cuda import engine_for, generate, policy, wait_for  # tests/gpu

from graphkeeper.proto import worker_pb2 as pb

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
]


def _graphs(status: pb.GraphStatus) -> list[tuple[int, int, float]]:
    # capture_seconds is measured at each capture: a recaptured graph would read differently.
    return sorted((c.mode, c.size, c.capture_seconds) for c in status.captured)


def test_a_change_of_only_the_sleep_settings_keeps_every_graph():
    engine = engine_for(policy(uid="sleepy"))
    try:
        before = engine.status()
        assert before.captured
        recaptures = engine.metrics.recaptures.labels("policy")._value.get()
        response = engine.apply_policy(policy(uid="sleepy", generation=2, sleep_after_idle_seconds=300,
                                              sleep_level=2))
        assert not response.recapture_started and not response.unchanged
        wait_for(lambda: engine.status().policy_generation == 2, what="generation 2 adopted")
        after = engine.status()
        assert after.state == pb.LIFECYCLE_STATE_READY
        assert _graphs(after) == _graphs(before)
        assert engine.metrics.recaptures.labels("policy")._value.get() == recaptures
        assert generate(engine, [5, 6, 7], 4).execution.graph_steps  # the same graphs replay
    finally:
        engine.drain_and_stop(5)
