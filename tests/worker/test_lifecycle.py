"""The lifecycle state machine (pure): the legal transitions and nothing else, listeners see every
move, an illegal move leaves the state alone, and moves after draining began are ignored."""

from __future__ import annotations

import pytest

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.lifecycle import (
    ALLOWED,
    SERVING_STATES,
    IllegalTransition,
    Lifecycle,
    check_transition,
)

S = pb.LifecycleState

HAPPY_PATH = [S.LIFECYCLE_STATE_LOADING, S.LIFECYCLE_STATE_MODEL_LOADED, S.LIFECYCLE_STATE_WARMED,
              S.LIFECYCLE_STATE_CAPTURED, S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING,
              S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_SLEEPING, S.LIFECYCLE_STATE_READY,
              S.LIFECYCLE_STATE_RECAPTURING, S.LIFECYCLE_STATE_DRAINING]
STATES = [s for s in S.values() if s != S.LIFECYCLE_STATE_UNSPECIFIED]
LEGAL = {(a, b) for a, b in zip(HAPPY_PATH, HAPPY_PATH[1:], strict=False)} | {
    (s, S.LIFECYCLE_STATE_DRAINING) for s in STATES if s != S.LIFECYCLE_STATE_DRAINING}


def test_lifecycle_happy_path_and_listeners():
    seen = []
    lifecycle = Lifecycle()
    lifecycle.subscribe(seen.append)
    for state in HAPPY_PATH[1:]:
        lifecycle.move(state)
    assert seen == HAPPY_PATH
    assert lifecycle.state == S.LIFECYCLE_STATE_DRAINING
    assert not lifecycle.serving


@pytest.mark.parametrize("current", STATES, ids=lambda s: S.Name(s))
def test_lifecycle_transition_table(current):
    for new in STATES:
        if (current, new) in LEGAL:
            check_transition(current, new)
        else:
            with pytest.raises(IllegalTransition, match="is not a lifecycle transition"):
                check_transition(current, new)
    assert {n for c, n in LEGAL if c == current} == set(ALLOWED[current])


def test_illegal_move_leaves_the_state_alone():
    lifecycle = Lifecycle()
    with pytest.raises(IllegalTransition, match="LOADING -> READY"):
        lifecycle.move(S.LIFECYCLE_STATE_READY)
    assert lifecycle.state == S.LIFECYCLE_STATE_LOADING


def test_only_ready_recapturing_and_sleeping_serve():
    # A sleeping worker takes requests (they wake it), so it stays in its Service.
    assert {S.LIFECYCLE_STATE_READY, S.LIFECYCLE_STATE_RECAPTURING, S.LIFECYCLE_STATE_SLEEPING} == SERVING_STATES


def test_moves_after_draining_began_are_ignored():
    # Shutdown can start while the engine thread is still capturing; its next move must not crash it.
    lifecycle = Lifecycle()
    lifecycle.move(S.LIFECYCLE_STATE_MODEL_LOADED)
    lifecycle.move(S.LIFECYCLE_STATE_DRAINING)
    lifecycle.move(S.LIFECYCLE_STATE_WARMED)
    assert lifecycle.state == S.LIFECYCLE_STATE_DRAINING
