"""``GraphStatus`` built from a snapshot of the GraphControl state and the engine's counters, without
an engine: a pushed policy is reported as pending, never as held; fallback counts are summed per
reason; a pending revision is clipped; the capture controller's modes and the ledger are echoed."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine.control import Control, Reload, default_policy
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.lifecycle import Lifecycle
from graphkeeper.worker.engine.recorder import StepRecorder
from graphkeeper.worker.engine.status import MAX_PENDING_REVISION, graph_status
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.executor.graphs.dispatcher import FULL, NONE, PIECEWISE, BatchDescriptor, Decision, Dispatcher
from graphkeeper.worker.executor.runner import ModelRunner
from graphkeeper.worker.metrics import WorkerMetrics

S = pb.LifecycleState
R = pb.FallbackReason
READY_PATH = (S.LIFECYCLE_STATE_MODEL_LOADED, S.LIFECYCLE_STATE_WARMED, S.LIFECYCLE_STATE_CAPTURED,
              S.LIFECYCLE_STATE_READY)


def ready_control() -> Control:
    control = Control(default_policy(), Lifecycle(), (4, 64))
    for state in READY_PATH:
        control.move(state)
    return control


def started_capture(control: Control, runner: ModelRunner) -> CaptureController:
    capture = CaptureController(Dispatcher(), WorkerMetrics(), max_num_seqs=4, max_num_batched_tokens=64,
                                inject_failures=frozenset())
    capture.begin(control.policy, runner)
    capture.run_all()
    return capture


def status(control: Control, runner: ModelRunner, recorder: StepRecorder | None = None,
           ledger: Ledger | None = None) -> pb.GraphStatus:
    return graph_status(control.snapshot(), capture=started_capture(control, runner),
                        recorder=recorder or StepRecorder(WorkerMetrics()), ledger=ledger or Ledger(),
                        model_revision="rev-1", running=3, queued=2)


def pushed(generation: int = 4) -> pb.GraphPolicy:
    return pb.GraphPolicy(policy_uid="uid-new", policy_name="ns/p", generation=generation,
                          mode=pb.GRAPH_MODE_PIECEWISE)


def test_a_pushed_policy_is_pending_not_held_until_the_engine_adopts_it(runner):
    control = ready_control()
    control.offer(pushed())
    before = status(control, runner)
    assert (before.pending_policy_uid, before.pending_policy_generation) == ("uid-new", 4)
    assert (before.policy_uid, before.policy_generation) == ("", 0)
    assert before.requested_mode == pb.GRAPH_MODE_FULL_AND_PIECEWISE  # the held default, not the pushed mode
    control.adopt(control.pending, recapture=True)
    after = status(control, runner)
    assert (after.policy_uid, after.policy_generation) == ("uid-new", 4)
    assert (after.pending_policy_uid, after.pending_policy_generation) == ("", 0)
    assert after.requested_mode == pb.GRAPH_MODE_PIECEWISE
    assert after.state == S.LIFECYCLE_STATE_RECAPTURING


def test_fallback_counts_are_summed_per_reason_and_graph_steps_in_total(runner):
    recorder = StepRecorder(WorkerMetrics())
    decode = BatchDescriptor(num_tokens=3, uniform_decode=True, graphs_allowed=True)
    for decision in [Decision(NONE, 3, R.FALLBACK_REASON_RECAPTURING), Decision(FULL, 4),
                     Decision(NONE, 3, R.FALLBACK_REASON_TENANT_DISABLED), Decision(PIECEWISE, 8),
                     Decision(NONE, 3, R.FALLBACK_REASON_RECAPTURING), Decision(FULL, 4)]:
        recorder.record(decision, decode, [], set(), 0.001)
    report = status(ready_control(), runner, recorder=recorder)
    assert list(report.fallbacks) == [pb.FallbackCount(reason=R.FALLBACK_REASON_TENANT_DISABLED, steps=1),
                                      pb.FallbackCount(reason=R.FALLBACK_REASON_RECAPTURING, steps=2)]
    assert report.eager_steps == 3
    assert report.graph_steps == 3


def test_a_pending_revision_is_clipped_to_128_characters(runner):
    control = ready_control()
    assert control.request_reload(Reload(source="/models/llama", revision="r" * 5000, future=Future()))
    report = status(control, runner)
    assert MAX_PENDING_REVISION == 128
    assert report.pending_model_revision == "r" * 128
    assert report.model_revision == "rev-1"


def test_a_pending_reload_without_a_revision_reports_its_source(runner):
    control = ready_control()
    assert control.request_reload(Reload(source="/models/llama-2", revision="", future=Future()))
    assert status(control, runner).pending_model_revision == "/models/llama-2"
    control.reload_failed("no such model")
    report = status(control, runner)
    assert report.pending_model_revision == ""
    assert report.last_error == "no such model"


def test_status_echoes_the_capture_modes_counts_and_ledger_on_a_cpu(runner):
    ledger = Ledger()
    ledger.record(pb.LEDGER_STAGE_KV_CACHE, torch.device("cpu"))
    ledger.record(pb.LEDGER_STAGE_WEIGHTS, torch.device("cpu"))
    report = status(ready_control(), runner, ledger=ledger)
    assert report.state == S.LIFECYCLE_STATE_READY
    assert report.effective_mode == pb.GRAPH_MODE_NONE and "CUDA" in report.mode_downgrade_reason
    assert not report.captured and not report.skipped and report.graph_memory_bytes == 0
    assert (report.running_sequences, report.queued_requests) == (3, 2)
    assert list(report.ledger) == [pb.LedgerEntry(stage=pb.LEDGER_STAGE_WEIGHTS),
                                   pb.LedgerEntry(stage=pb.LEDGER_STAGE_KV_CACHE)]  # lifecycle order, 0 B on a CPU
    assert not report.HasField("compile")


def test_a_size_left_without_a_graph_reports_the_eager_time_its_steps_cost(runner):
    """A coarse size released as compute bound runs its steps eager: status carries the eager time
    measured at capture beside the reason (what the step-time model prices those steps with); a
    size never timed reports 0."""
    from types import SimpleNamespace

    from graphkeeper.worker.executor.graphs.graph_set import Skipped

    control = ready_control()
    capture = started_capture(control, runner)
    capture.graph_set = SimpleNamespace(
        captured={}, released={}, memory_bytes=0, eager_seconds={512: 0.0071, 1024: 0.0076},
        skipped={(PIECEWISE, 1024): Skipped(R.FALLBACK_REASON_COMPUTE_BOUND, "replaying 1024 tokens ..."),
                 (PIECEWISE, 2048): Skipped(R.FALLBACK_REASON_SIZE_OVER_BUDGET, "over the budget")})
    report = graph_status(control.snapshot(), capture=capture, recorder=StepRecorder(WorkerMetrics()),
                          ledger=Ledger(), model_revision="rev-1", running=0, queued=0)
    assert [(s.size, s.reason, s.eager_seconds) for s in report.skipped] == [
        (1024, R.FALLBACK_REASON_COMPUTE_BOUND, 0.0076), (2048, R.FALLBACK_REASON_SIZE_OVER_BUDGET, 0.0)]
