"""``graphkeeper generate`` and ``graphkeeper status``: small gRPC clients of a worker.

They import only grpc and the generated proto code, never torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import grpc
from google.protobuf import json_format

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import lifecycle_name, mode_name, reason_name

DEFAULT_CONTROL_PORT = 50052


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
    return f"{host}:{DEFAULT_CONTROL_PORT}"


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


def status_cmd(args: argparse.Namespace) -> int:
    try:
        token = read_token(args.token_file)
    except OSError as err:
        print(f"error: --token-file: {err}", file=sys.stderr)
        return 2
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(args.target) as channel, \
            grpc.insecure_channel(control_target(args.target, args.control_target)) as control:
        try:
            info = pb_grpc.InferenceWorkerStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
            status = pb_grpc.GraphControlStub(control).GetGraphStatus(
                pb.GetGraphStatusRequest(), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2
    if args.json:
        doc = {"model": json_format.MessageToDict(info, preserving_proto_field_name=True),
               "graphs": json_format.MessageToDict(status, preserving_proto_field_name=True)}
        print(json.dumps(doc, indent=2))
        return 0
    print(f"model     {info.source} revision {info.revision} ({info.dtype} on {info.device}, "
          f"{info.parameter_count} parameters)")
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
    print(f"captured  {sizes}; {status.graph_memory_bytes} B graph memory, {status.total_capture_seconds:.2f} s")
    for s in status.skipped:
        print(f"skipped   {mode_name(s.mode)}:{s.size} {reason_name(s.reason)}: {s.message}")
    fallbacks = ", ".join(f"{reason_name(f.reason)}={f.steps}" for f in status.fallbacks) or "none"
    print(f"steps     graph {status.graph_steps}, eager {status.eager_steps} (fallbacks: {fallbacks})")
    print(f"serving   {status.running_sequences} running, {status.queued_requests} queued")
    if status.HasField("kv_cache"):
        print(kv_cache_line(status.kv_cache))
    if status.last_error:
        print(f"error     {status.last_error}")
    return 0
