"""The serving counters a canary is compared on, end to end on a real worker process (CPU, the
engine core in a process of its own): they move with the tokens served and start over when a
policy is adopted, like the traffic histogram."""

from __future__ import annotations

import pytest
from worker_harness import generate_concurrently, make_request, wait_until

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.serving_counters import ITL_BOUNDS_SECONDS

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def counters_worker(module_workers):
    return module_workers()


def test_the_serving_counters_move_with_served_tokens_and_restart_at_an_adoption(counters_worker):
    worker = counters_worker
    before = worker.status().serving
    generate_concurrently(worker, [make_request(p, NEW_TOKENS) for p in PROMPTS])
    status = worker.status()
    after = status.serving
    served = len(PROMPTS) * NEW_TOKENS
    assert after.generated_tokens - before.generated_tokens == served
    assert after.sequence_seconds > before.sequence_seconds
    # Every step counted once, here as in the step totals (on the CPU every step runs eager).
    assert after.graph_steps + after.eager_steps == status.graph_steps + status.eager_steps
    assert after.eager_steps == status.eager_steps and after.replayed_tokens == after.padded_tokens == 0
    assert list(after.itl_bounds_seconds) == list(ITL_BOUNDS_SECONDS)
    assert len(after.itl_counts) == len(ITL_BOUNDS_SECONDS) + 1
    assert sum(after.itl_counts) == after.generated_tokens
    assert after.since_unix_seconds == status.traffic.since_unix_seconds
    # A policy adopted: counting starts over, then moves with what is served under it.
    policy = pb.GraphPolicy(policy_uid="counters-policy", policy_name="default/counters", generation=1,
                            mode=pb.GRAPH_MODE_PIECEWISE)
    worker.control.ApplyGraphPolicy(pb.ApplyGraphPolicyRequest(policy=policy), timeout=30)
    wait_until(lambda: worker.status().policy_generation == 1
               and worker.status().state == pb.LIFECYCLE_STATE_READY, timeout=60, what="the policy adopted")
    fresh = worker.status().serving
    assert fresh.generated_tokens == 0 and fresh.since_unix_seconds > after.since_unix_seconds
    generate_concurrently(worker, [make_request(PROMPTS[0], NEW_TOKENS)])
    assert worker.status().serving.generated_tokens == NEW_TOKENS
