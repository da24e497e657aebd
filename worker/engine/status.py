"""What the worker reports about itself: ``GetModelInfo`` and ``GraphStatus``, built from what the
engine has adopted (the engine takes the snapshot under its status lock and passes it here)."""

from __future__ import annotations

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import effective_requested_mode
from graphkeeper.worker.engine.control import Snapshot
from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.recorder import GraphUse, StepRecorder
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.executor.graphs.graph_set import CapturedGraph
from graphkeeper.worker.model.loader import LoadedModel
from graphkeeper.worker.model.tokenizer import Tokenizer

#: Longest pending revision or source echoed in status.
MAX_PENDING_REVISION = 128
#: Longest last error reported (a capture failure carries the exception's text, which can be long).
MAX_LAST_ERROR = 1024


def model_info(loaded: LoadedModel | None, max_seq_len: int, max_num_seqs: int, eos_ids: frozenset[int] = frozenset(),
               tokenizer: Tokenizer | None = None, step_budget: pb.StepBudgetStatus | None = None,
               ) -> pb.GetModelInfoResponse | None:
    if loaded is None:
        return None
    c = loaded.full_config  # the whole model's shapes, also on a tensor parallel rank
    return pb.GetModelInfoResponse(
        source=loaded.source, revision=loaded.revision, architecture="LlamaForCausalLM",
        dtype=str(loaded.dtype).removeprefix("torch."), vocab_size=c.vocab_size, hidden_size=c.dim,
        num_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
        max_seq_len=max_seq_len, max_num_seqs=max_num_seqs, eos_token_id=c.eos_token_id,
        device=str(loaded.device), parameter_count=loaded.parameter_count,
        eos_token_ids=[c.eos_token_id, *sorted(eos_ids - {c.eos_token_id})],
        model_context_length=c.max_position_embeddings, tokenizer=tokenizer is not None,
        chat_template=tokenizer is not None and tokenizer.has_chat_template, step_budget=step_budget,
        tensor_parallel_size=loaded.tp.size,
    )


def graph_status(snap: Snapshot, *, capture: CaptureController, recorder: StepRecorder, ledger: Ledger,
                 model_revision: str, running: int, queued: int,
                 compile: pb.CompileStatus | None = None, kv_cache: pb.KVCacheStatus | None = None,
                 step_budget: pb.StepBudgetStatus | None = None,
                 startup: pb.StartupStatus | None = None, sleep: pb.SleepStatus | None = None,
                 tensor_parallel_size: int = 1) -> pb.GraphStatus:
    """``GraphStatus`` from a snapshot of the GraphControl state and the engine's counters (pure)."""
    c, policy, pending = capture, snap.policy, snap.pending
    graphs = c.graph_set
    captured = {**graphs.captured, **graphs.released} if graphs else {}
    released = set(graphs.released) if graphs else set()
    use = dict(recorder.graph_use)
    skipped = dict(graphs.skipped) if graphs else {}
    timed = dict(graphs.eager_seconds) if graphs else {}
    eager = dict(recorder.eager_steps)
    return pb.GraphStatus(
        state=snap.state,
        # From the adopted policy (read under the engine's status lock), not from the capture
        # controller, which learns it a moment later when the recapture begins.
        requested_mode=effective_requested_mode(policy),
        effective_mode=c.effective_mode,
        mode_downgrade_reason=c.downgrade_reason,
        policy_uid=policy.policy_uid,
        policy_generation=policy.generation,
        pending_policy_uid=pending.policy_uid if pending else "",
        pending_policy_generation=pending.generation if pending else 0,
        pending_model_revision=snap.pending_revision[:MAX_PENDING_REVISION],
        model_revision=model_revision,
        captured=[captured_size(key, entry, use.get(key), key in released) for key, entry in sorted(captured.items())],
        skipped=[pb.SkippedSize(size=s, mode=m, reason=v.reason, message=v.message, eager_seconds=timed.get(s, 0.0))
                 for (m, s), v in sorted(skipped.items())],
        fallbacks=[pb.FallbackCount(reason=r, steps=n) for r, n in sorted(eager.items())],
        graph_steps=sum(dict(recorder.graph_steps).values()),
        eager_steps=sum(eager.values()),
        graph_memory_bytes=graphs.memory_bytes if graphs else 0,
        total_capture_seconds=c.total_seconds,
        capture_parts=[pb.CapturePart(part=part, seconds=seconds) for part, seconds in c.parts.items()],
        ledger=ledger.to_proto(),
        previous_ledger=ledger.previous_to_proto(),
        running_sequences=running,
        queued_requests=queued,
        last_error=snap.last_error[:MAX_LAST_ERROR],
        compile=compile,
        traffic=recorder.traffic.to_proto(),
        serving=recorder.serving.to_proto(),
        kv_cache=kv_cache, step_budget=step_budget,
        startup=startup, sleep=sleep, tensor_parallel_size=tensor_parallel_size,
    )


def captured_size(key: tuple[int, int], entry: CapturedGraph, use: GraphUse | None, released: bool) -> pb.CapturedSize:
    """One graph's line in status: what it cost (memory, capture time), what it buys per step (GPU
    time replayed against eager), and what it earned (replays, padding)."""
    mode, size = key
    return pb.CapturedSize(
        size=size, mode=mode, capture_seconds=entry.seconds, device_bytes=entry.device_bytes,
        reserved_bytes=entry.reserved_bytes, replay_seconds=entry.replay_seconds, eager_seconds=entry.eager_seconds,
        replays=use.replays if use else 0, padded_tokens=use.padded_tokens if use else 0, released=released)


def kv_cache_status(block_size: int, counts: tuple[int, int, int, int, int], *, prefix_caching: bool,
                    preemptions: int, nbytes: int, sizing: str = "explicit") -> pb.KVCacheStatus:
    """``KVCacheStatus`` from the block manager's counts (total, used, cached, queries, hits) (pure)."""
    total, used, cached, queries, hits = counts
    return pb.KVCacheStatus(block_size=block_size, blocks_total=total, blocks_used=used, blocks_cached=cached,
                            prefix_caching=prefix_caching, prefix_query_tokens=queries, prefix_hit_tokens=hits,
                            preemptions=preemptions, bytes=nbytes, sizing=sizing)
