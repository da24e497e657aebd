"""``graphkeeper generate``, ``graphkeeper status`` and ``graphkeeper graphs``: small gRPC clients of a worker.

They import only grpc and the generated proto code, never torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import grpc
from google.protobuf import json_format

from graphkeeper.command_error import CommandError
from graphkeeper.proto import ports
from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.enums import lifecycle_name, mode_name, reason_name


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    chat = getattr(args, "chat", "")
    messages = [*([pb.ChatMessage(role="system", content=args.system)] if chat and args.system else []),
                *([pb.ChatMessage(role="user", content=chat)] if chat else [])]
    return pb.GenerateRequest(
        tenant=args.tenant, prompt_token_ids=_ids(args.prompt_ids or ""), prompt_text=args.prompt or "",
        messages=messages, sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=args.max_new_tokens, stop_token_ids=_ids(args.stop_ids)),
    )


def summary_dict(summary: pb.ExecutionSummary) -> dict[str, Any]:
    """The execution summary with label-form names, as people and scripts read it."""
    return {
        "graph_steps": [{"mode": mode_name(g.mode), "size": g.size, "steps": g.steps} for g in summary.graph_steps],
        "eager_steps": [{"reason": reason_name(e.reason), "steps": e.steps} for e in summary.eager_steps],
    }


def generate_cmd(args: argparse.Namespace) -> int:
    request = build_request(args)
    texts = bool(args.prompt) or bool(getattr(args, "chat", ""))
    if bool(args.prompt) + bool(args.prompt_ids) + bool(getattr(args, "chat", "")) != 1:
        print("error: give exactly one of --chat, --prompt and --prompt-ids", file=sys.stderr)
        return 2
    tokens: list[int] = []
    text: list[str] = []
    completion = pb.Completion()
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.InferenceWorkerStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout):
                if response.HasField("tokens"):
                    chunk = response.tokens
                    tokens.extend(chunk.token_ids)
                    text.append(chunk.text)
                    if args.json:
                        continue
                    if texts:
                        print(chunk.text, end="", flush=True)
                    else:
                        print(" ".join(map(str, chunk.token_ids)), end=" ", flush=True)
                else:
                    completion = response.completion
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
    result = {
        "request_id": completion.request_id,
        "token_ids": tokens,
        **({"text": "".join(text)} if texts else {}),
        "finish_reason": pb.FinishReason.Name(completion.finish_reason).removeprefix("FINISH_REASON_").lower(),
        "prompt_tokens": completion.prompt_tokens,
        "generated_tokens": completion.generated_tokens,
        "time_to_first_token_seconds": completion.time_to_first_token_seconds,
        "total_seconds": completion.total_seconds,
        "execution": summary_dict(completion.execution),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\nfinish: {result['finish_reason']}; execution: {json.dumps(result['execution'])}")
    return 0


def control_target(target: str, control: str) -> str:
    """The control address: ``control`` when given, else the inference host on the default control port."""
    if control:
        return control
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return f"{host}:{ports.CONTROL_PORT}"


def read_token(path: str) -> str:
    path = path or os.environ.get("GRAPHKEEPER_CONTROL_TOKEN_FILE", "")
    return open(path).read().strip() if path else ""  # noqa: SIM115 - tiny file, read once


def kv_cache_line(kv: pb.KVCacheStatus) -> str:
    """The KV cache in one line: blocks, prefix cache hits, preemptions, bytes and how it was sized."""
    usage = kv.blocks_used / kv.blocks_total if kv.blocks_total else 0.0
    prefix = (f"prefix cache {kv.prefix_hit_tokens}/{kv.prefix_query_tokens} tokens hit" if kv.prefix_caching
              else "prefix cache off")
    sized = kv.sizing or "explicit"
    if kv.planned_bytes:
        sized += f", planned {kv.planned_bytes} B, free after capture {kv.free_after_capture_bytes} B"
    return (f"kv cache  {kv.blocks_used}/{kv.blocks_total} blocks of {kv.block_size} tokens used ({usage:.0%}), "
            f"{kv.blocks_cached} cached; {prefix}; {kv.preemptions} preemptions; {kv.bytes} B ({sized})")


def step_budget_line(b: pb.StepBudgetStatus) -> str:
    """The step budget in one line: the whole budget, the bound with decode rows and why."""
    came = f" ({b.tokens_source})" if b.tokens_source else ""  # empty from a worker before the field
    if not b.itl_target_seconds:
        return f"budget    {b.tokens} tokens a step{came} ({b.source})"
    return (f"budget    {b.tokens} tokens a step with no decode row{came}, {b.tokens_with_decode} with decode rows "
            f"(inter-token target {b.itl_target_seconds * 1e3:.2f} ms: {b.source})")


def fetch_status(args: argparse.Namespace, with_model: bool) -> tuple[pb.GetModelInfoResponse | None, pb.GraphStatus]:
    """The worker's graph status (and its model info, when asked) over the control port with the
    control token, for ``status`` and ``graphs``; CommandError says what went wrong."""
    try:
        token = read_token(args.token_file)
    except OSError as err:
        raise CommandError(f"--token-file: {err}") from None
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(args.target) as channel, \
            grpc.insecure_channel(control_target(args.target, args.control_target)) as control:
        try:
            info = (pb_grpc.InferenceWorkerStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
                    if with_model else None)
            status = pb_grpc.GraphControlStub(control).GetGraphStatus(
                pb.GetGraphStatusRequest(), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as err:
            raise CommandError(f"{err.code().name}: {err.details()}") from None
    return info, status


def status_cmd(args: argparse.Namespace) -> int:
    info, status = fetch_status(args, with_model=True)
    if args.json:
        doc = {"model": json_format.MessageToDict(info, preserving_proto_field_name=True),
               "graphs": json_format.MessageToDict(status, preserving_proto_field_name=True)}
        print(json.dumps(doc, indent=2))
        return 0
    ranks = (f", {info.tensor_parallel_size} tensor parallel ranks (rank 0's shard)"
             if info.tensor_parallel_size > 1 else "")
    print(f"model     {info.source} revision {info.revision} ({info.dtype} on {info.device}, "
          f"{info.parameter_count} parameters{ranks})")
    print(f"state     {lifecycle_name(status.state)}")
    downgrade = f" ({status.mode_downgrade_reason})" if status.mode_downgrade_reason else ""
    print(f"mode      requested {mode_name(status.requested_mode)}, effective {mode_name(status.effective_mode)}"
          f"{downgrade}")
    c = status.compile
    compiled = (f"compiled ({c.cache} cache, {c.compiled_graphs} graphs, {c.seconds:.1f} s)" if c.enabled
                else f"not compiled ({c.reason})" if c.reason else "not compiled")
    print(f"step      -O{c.optimization_level}, {compiled}; kernels {c.kernels or '-'}; "
          f"weights {c.quantization or '-'}")
    print(f"policy    {status.policy_uid or '(worker default)'} generation {status.policy_generation}"
          + (f" (pending: generation {status.pending_policy_generation})" if status.pending_policy_uid else ""))
    sizes = ", ".join(f"{mode_name(c.mode)}:{c.size}" for c in status.captured) or "none"
    per_rank = " per rank" if status.tensor_parallel_size > 1 else ""
    print(f"captured  {sizes}; {status.graph_memory_bytes} B graph memory{per_rank}, "
          f"{status.total_capture_seconds:.2f} s")
    for s in status.skipped:
        print(f"skipped   {mode_name(s.mode)}:{s.size} {reason_name(s.reason)}: {s.message}")
    fallbacks = ", ".join(f"{reason_name(f.reason)}={f.steps}" for f in status.fallbacks) or "none"
    print(f"steps     graph {status.graph_steps}, eager {status.eager_steps} (fallbacks: {fallbacks})")
    print(f"serving   {status.running_sequences} running, {status.queued_requests} queued")
    if status.startup.stages:
        print(startup_line(status.startup))
    if status.HasField("kv_cache"):
        print(kv_cache_line(status.kv_cache))
    if status.HasField("step_budget"):
        print(step_budget_line(status.step_budget))
    if status.HasField("sleep"):
        print(sleep_line(status.sleep))
    if status.last_error:
        print(f"error     {status.last_error}")
    return 0


def startup_line(startup: pb.StartupStatus) -> str:
    """``startup   READY 13.6 s, caches warm (compile hit, tuning hit); capture 5.0 s, ...`` (pure):
    the stages, longest first."""
    stages = sorted((s for s in startup.stages if s.seconds >= 0.05), key=lambda s: -s.seconds)
    return (f"startup   READY {startup.ready_seconds:.1f} s after the process started, caches {startup.caches} "
            f"(compile {startup.compile_cache}, tuning {startup.tuning_cache}); "
            + (", ".join(f"{s.stage} {s.seconds:.1f} s" for s in stages) or "every stage under 0.05 s"))


def sleep_line(sleep: pb.SleepStatus) -> str:
    """``sleep     level 1 since 2026-12-04 21:40:00 UTC, 24.0 GiB released; 2 sleeps, 1 wake (last
    0.42 s)`` (pure): whether the worker sleeps, or why it cannot."""
    if sleep.unavailable_reason:
        return f"sleep     unavailable: {sleep.unavailable_reason}"
    if sleep.level:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(sleep.since_unix_seconds))
        state = f"level {sleep.level} since {since}, {sleep.released_bytes / (1 << 30):.1f} GiB released"
    else:
        state = "awake" + (f" (a level {sleep.pending_level} sleep waits for running sequences)"
                           if sleep.pending_level else "")
    last = f" (last {sleep.last_wake_seconds:.2f} s)" if sleep.wakes else ""
    return f"sleep     {state}; {sleep.sleeps} sleeps, {sleep.wakes} wakes{last}"


MIB = float(1 << 20)
#: Columns of ``graphkeeper graphs``, in order.
GRAPH_COLUMNS = ("mode", "size", "memory_mib", "capture_s", "replay_ms", "eager_ms", "gain_ms", "gain_ms_per_mib",
                 "replays", "padded_tokens", "saved_s", "released")
#: Step shapes ``graphkeeper graphs`` lists (the most frequent first); ``--json`` gives them all.
TOP_SHAPES = 10


def graph_rows(status: pb.GraphStatus) -> list[dict[str, Any]]:
    """What each captured graph buys, one dict per (mode, size), then the whole set as ``mode="total"``.

    Per graph: memory (its measured ``device_bytes``: the first, largest capture sizes the shared
    pool, so smaller graphs that reuse its blocks cost little), capture time, the GPU time of one
    step replayed and eager (validation), the gain per step and per MiB, what traffic made of it
    (replays, padding) and the time it saved (replays x gain). The total row holds the set's
    measured graph memory and capture phase time, the gain per step averaged over the replays (or
    over the graphs, with no replay yet), that gain per MiB of the whole set, and the sums.
    Step times are 0 off the GPU, where no graph is captured.
    """
    rows = []
    for c in status.captured:
        gain = c.eager_seconds - c.replay_seconds if c.replay_seconds and c.eager_seconds else 0.0
        mib = c.device_bytes / MIB
        rows.append({
            "mode": mode_name(c.mode), "size": c.size, "memory_mib": mib, "capture_s": c.capture_seconds,
            "replay_ms": c.replay_seconds * 1e3, "eager_ms": c.eager_seconds * 1e3, "gain_ms": gain * 1e3,
            "gain_ms_per_mib": gain * 1e3 / mib if mib > 0 else None, "replays": c.replays,
            "padded_tokens": c.padded_tokens, "saved_s": gain * c.replays, "released": c.released,
        })
    replays = sum(r["replays"] for r in rows)
    weights = [r["replays"] for r in rows] if replays else [1] * len(rows)

    def mean(column: str) -> float:
        return sum(r[column] * w for r, w in zip(rows, weights, strict=True)) / sum(weights) if rows else 0.0

    mib = status.graph_memory_bytes / MIB
    gain = mean("gain_ms")
    rows.append({
        "mode": "total", "size": len(rows), "memory_mib": mib, "capture_s": status.total_capture_seconds,
        "replay_ms": mean("replay_ms"), "eager_ms": mean("eager_ms"), "gain_ms": gain,
        "gain_ms_per_mib": gain / mib if mib > 0 else None, "replays": replays,
        "padded_tokens": sum(r["padded_tokens"] for r in rows), "saved_s": sum(r["saved_s"] for r in rows),
        "released": sum(1 for r in rows if r["released"]),
    })
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def graphs_table(status: pb.GraphStatus) -> list[str]:
    """``graph_rows`` as aligned text lines, then the traffic histogram's summary."""
    rows = graph_rows(status)
    header = ("MODE", "SIZE", "MEMORY MiB", "CAPTURE s", "REPLAY ms", "EAGER ms", "GAIN ms", "GAIN ms/MiB",
              "REPLAYS", "PADDED", "SAVED s", "RELEASED")
    cells = [header, *[tuple(_cell(r[c]) for c in GRAPH_COLUMNS) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    if len(rows) == 1:
        lines.insert(1, f"(no graphs captured: effective mode {mode_name(status.effective_mode)}"
                        + (f", {status.mode_downgrade_reason})" if status.mode_downgrade_reason else ")"))
    for s in status.skipped:
        lines.append(f"skipped {mode_name(s.mode)}:{s.size} {reason_name(s.reason)}")
    t = status.traffic
    lines.append(f"traffic: {t.steps} steps ({t.overflow_steps} unbinned) in {len(t.shapes)} shapes since "
                 f"{t.since_unix_seconds:.0f} (policy {t.policy_uid or '(worker default)'} generation "
                 f"{t.policy_generation})")
    for shape in sorted(t.shapes, key=lambda s: -s.steps)[:TOP_SHAPES]:
        kind = "decode" if shape.uniform_decode else "mixed"
        lines.append(f"  {shape.steps:>8} steps  {shape.num_tokens:>5} tokens  {shape.num_seqs:>4} seqs  {kind}")
    return lines


def graphs_cmd(args: argparse.Namespace) -> int:
    """``graphkeeper graphs``: what each captured graph costs and buys, from GetGraphStatus."""
    _, status = fetch_status(args, with_model=False)
    if args.json:
        traffic = json_format.MessageToDict(status.traffic, preserving_proto_field_name=True)
        print(json.dumps({"graphs": graph_rows(status), "traffic": traffic}, indent=2))
        return 0
    print("\n".join(graphs_table(status)))
    return 0
