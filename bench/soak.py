"""Soak: a real worker process under mixed load for minutes, watched from a separate client.

This script starts ``graphkeeper worker`` as a child process and is itself the client (its
threads are client connections; nothing runs inside the worker but the worker). For
``--duration`` seconds it keeps ``--concurrency`` Generate streams going, with mixed prompt and
output lengths, greedy and seeded sampling, three tenants, and random cancellations; every few
seconds it pushes a new GraphPolicy (tenant toggles, capture-size changes). It reports:

- every call's outcome by status code (a cancellation the client asked for is its own outcome);
- lost or duplicated tokens: each completed stream's token count against
  ``Completion.generated_tokens``, and every greedy request against the first answer to the same
  prompt (the same prompt must give the same tokens every time);
- the worker's resident memory (VmRSS from /proc) sampled over the run, and whether it is still
  alive, READY and healthy at the end, and its exit code after SIGTERM.

    python bench/soak.py                         # 120 s on the CPU, random:tiny
    python bench/soak.py --duration 600 --device cuda --model random:llama-1b
    python bench/soak.py --write                 # also writes bench/results/soak-<device>.{json,md}
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ports import free_port  # noqa: E402  (tests/ports.py: below the ephemeral range, never handed out twice)

RESULTS = Path(__file__).parent / "results"
TENANTS = ("", "chat", "batch")


def vm_rss_bytes(pid: int) -> int:
    """The worker's resident set (VmRSS), in bytes, its children's included (the engine core is a
    child process of the worker); 0 once it is gone."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total = int(line.split()[1]) * 1024
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return total
    return total + sum(vm_rss_bytes(child) for child in children)


@dataclass
class Tally:
    """Everything the client threads observe; one lock, since they all write it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    policy_outcomes: collections.Counter = field(default_factory=collections.Counter)
    tokens: int = 0
    count_mismatches: list[dict] = field(default_factory=list)
    greedy_reference: dict[tuple, list[int]] = field(default_factory=dict)
    greedy_checked: int = 0
    greedy_mismatches: list[dict] = field(default_factory=list)
    error_samples: dict[str, str] = field(default_factory=dict)

    def outcome(self, name: str, details: str = "") -> None:
        with self.lock:
            self.outcomes[name] += 1
            if details and name not in self.error_samples:
                self.error_samples[name] = details[:200]


@dataclass(frozen=True)
class Shape:
    prompt: tuple[int, ...]
    max_new: int
    greedy: bool
    seed: int
    tenant: str
    cancel_after: int  # tokens received before the client cancels; 0 never cancels


def draw_shape(rng: random.Random, vocab: int, max_seq_len: int, greedy_prompts: list[tuple[int, ...]],
               cancel_rate: float) -> Shape:
    """Mixed traffic: short chats and long prompts, a pool of repeated greedy prompts, some cancellations."""
    greedy = rng.random() < 0.5
    if greedy:
        prompt = rng.choice(greedy_prompts)
        max_new = 8 + (sum(prompt) % 25)  # the same prompt always asks for the same length
    else:
        length = rng.choice((rng.randint(1, 16), rng.randint(16, 64), rng.randint(64, max_seq_len // 2)))
        prompt = tuple(rng.randrange(vocab) for _ in range(length))
        max_new = rng.choice((rng.randint(1, 8), rng.randint(8, 48)))
    max_new = max(1, min(max_new, max_seq_len - len(prompt)))
    cancel_after = rng.randint(1, max_new) if rng.random() < cancel_rate else 0
    return Shape(prompt, max_new, greedy, rng.randrange(2**32), rng.choice(TENANTS), cancel_after)


def request_for(shape: Shape, request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0) if shape.greedy else pb.SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, seed=shape.seed)
    return pb.GenerateRequest(
        request_id=request_id, tenant=shape.tenant, prompt_token_ids=list(shape.prompt), sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=shape.max_new, ignore_eos=True),
    )


def run_stream(stub: pb_grpc.InferenceWorkerStub, shape: Shape, request_id: str, tally: Tally,
               timeout: float) -> None:
    call = stub.Generate(request_for(shape, request_id), timeout=timeout)
    received: list[int] = []
    completion = None
    try:
        for response in call:
            if response.HasField("tokens"):
                received.extend(response.tokens.token_ids)
                if shape.cancel_after and len(received) >= shape.cancel_after:
                    call.cancel()
            else:
                completion = response.completion
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.CANCELLED and shape.cancel_after:
            tally.outcome("CANCELLED_BY_CLIENT")
        else:
            tally.outcome(err.code().name, err.details() or "")
        return
    if completion is None:
        tally.outcome("NO_COMPLETION")
        return
    with tally.lock:
        tally.outcomes["OK"] += 1
        tally.tokens += len(received)
        tally.finish_reasons[pb.FinishReason.Name(completion.finish_reason)] += 1
        if len(received) != completion.generated_tokens:
            tally.count_mismatches.append({"request_id": request_id, "received": len(received),
                                           "generated_tokens": completion.generated_tokens})
        if shape.greedy:
            key = (shape.prompt, shape.max_new)
            reference = tally.greedy_reference.setdefault(key, received)
            tally.greedy_checked += 1
            if received != reference:
                tally.greedy_mismatches.append({"request_id": request_id, "prompt_len": len(shape.prompt),
                                                "expected": reference[:16], "got": received[:16]})


def client_loop(target: str, seed: int, stop: threading.Event, tally: Tally, args: argparse.Namespace,
                greedy_prompts: list[tuple[int, ...]], vocab: int) -> None:
    rng = random.Random(seed)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceWorkerStub(channel)
        n = 0
        while not stop.is_set():
            n += 1
            shape = draw_shape(rng, vocab, args.max_seq_len, greedy_prompts, args.cancel_rate)
            run_stream(stub, shape, f"soak-{seed}-{n}", tally, timeout=args.request_timeout)


def policy_for(generation: int, rng: random.Random, budget: int) -> pb.GraphPolicy:
    """Alternating tenant toggles and capture sizes: every push changes something."""
    sizes = sorted(rng.sample(range(1, budget + 1), k=rng.randint(1, min(6, budget))))
    graphs = (pb.TENANT_GRAPHS_ENABLED, pb.TENANT_GRAPHS_DISABLED)
    return pb.GraphPolicy(
        policy_uid="soak", policy_name="bench/soak", generation=generation, mode=pb.GRAPH_MODE_FULL_AND_PIECEWISE,
        capture_sizes=pb.CaptureSizes(explicit=pb.ExplicitSizes(sizes=sizes)),
        tenants=[pb.TenantToggle(tenant="chat", graphs=graphs[generation % 2]),
                 pb.TenantToggle(tenant="batch", graphs=graphs[(generation + 1) % 2])],
    )


class Control:
    """GraphControl on its own port with a bearer token where the worker has one, else the main port."""

    def __init__(self, target: str, control_target: str, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.channel = grpc.insecure_channel(control_target)
        self.stub = pb_grpc.GraphControlStub(self.channel)
        try:
            self.stub.GetGraphStatus(pb.GetGraphStatusRequest(), timeout=3, metadata=self.metadata)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            self.channel.close()  # no separate control port (yet): control shares the main one
            self.channel = grpc.insecure_channel(target)
            self.stub = pb_grpc.GraphControlStub(self.channel)

    def status(self) -> pb.GraphStatus:
        return self.stub.GetGraphStatus(pb.GetGraphStatusRequest(), timeout=10, metadata=self.metadata)

    def apply(self, policy: pb.GraphPolicy) -> pb.ApplyGraphPolicyResponse:
        return self.stub.ApplyGraphPolicy(pb.ApplyGraphPolicyRequest(policy=policy), timeout=30,
                                          metadata=self.metadata)


def policy_loop(control: Control, stop: threading.Event, tally: Tally, interval: float, budget: int) -> None:
    rng = random.Random(7)
    generation = 0
    while not stop.wait(interval):
        generation += 1
        try:
            control.apply(policy_for(generation, rng, budget))
            with tally.lock:
                tally.policy_outcomes["OK"] += 1
        except grpc.RpcError as err:
            with tally.lock:
                tally.policy_outcomes[err.code().name] += 1
                tally.error_samples.setdefault(f"policy {err.code().name}", (err.details() or "")[:200])


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"soak: the worker exited with {proc.returncode} before it was ready")
            try:
                if health.Check(health_pb2.HealthCheckRequest(service="graphkeeper.worker.v1.InferenceWorker"),
                                timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit("soak: the worker did not become ready in time")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except OSError:
        return 0


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=Path(__file__).parent).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def soak(args: argparse.Namespace) -> dict:
    port, metrics_port, control_port = free_port(), free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    token_file = workdir / "control-token"
    token = os.urandom(16).hex()
    token_file.write_text(token + "\n")
    log_path = workdir / "worker.log"
    cmd = [
        str(Path(sys.executable).parent / "graphkeeper"), "worker", "--model", args.model, "--device", args.device,
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--control-port", str(control_port), "--control-token-file", str(token_file), "--http-port", "0",
        "--max-num-seqs", str(args.max_num_seqs), "--max-seq-len", str(args.max_seq_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-queue", str(args.max_queue),
        "--drain-seconds", "30",
    ]
    target = f"127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(target, proc)
        control = Control(target, f"127.0.0.1:{control_port}", token)
        with grpc.insecure_channel(target) as channel:
            info = pb_grpc.InferenceWorkerStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        rng = random.Random(args.seed)
        greedy_prompts = [tuple(rng.randrange(info.vocab_size) for _ in range(rng.randint(1, 40)))
                          for _ in range(12)]
        tally = Tally()
        stop = threading.Event()
        rss: list[tuple[float, int]] = []
        started = time.monotonic()
        threads = [threading.Thread(target=client_loop, daemon=True,
                                    args=(target, args.seed + i, stop, tally, args, greedy_prompts, info.vocab_size))
                   for i in range(args.concurrency)]
        threads.append(threading.Thread(target=policy_loop, daemon=True,
                                        args=(control, stop, tally, args.policy_interval, args.max_num_batched_tokens)))
        for t in threads:
            t.start()
        while (elapsed := time.monotonic() - started) < args.duration:
            rss.append((round(elapsed, 1), vm_rss_bytes(proc.pid)))
            if proc.poll() is not None:
                break
            time.sleep(min(args.rss_interval, max(0.0, args.duration - elapsed)))
        stop.set()
        for t in threads:
            t.join(timeout=args.request_timeout + 30)
        rss.append((round(time.monotonic() - started, 1), vm_rss_bytes(proc.pid)))
        alive = proc.poll() is None
        end_state = pb.LifecycleState.Name(control.status().state) if alive else "EXITED"
        healthz = http_status(f"http://127.0.0.1:{metrics_port}/healthz") if alive else 0
        control.channel.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    warm = [b for t, b in rss if t >= min(args.warmup, args.duration / 4)] or [b for _, b in rss]
    requests = sum(tally.outcomes.values())
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": args.machine or f"{platform.node()} ({os.cpu_count()} CPUs)",
        "command": shlex.join(["python", *sys.argv]),
        "commit": git_commit(),
        "worker_command": shlex.join(cmd[1:]).replace(str(token_file), "<token-file>"),
        "duration_seconds": args.duration, "concurrency": args.concurrency,
        "requests": requests,
        "outcomes": dict(tally.outcomes.most_common()),
        "finish_reasons": dict(tally.finish_reasons),
        "policy_pushes": dict(tally.policy_outcomes),
        "tokens_streamed": tally.tokens,
        "token_count_mismatches": len(tally.count_mismatches),
        "greedy_checked": tally.greedy_checked, "greedy_mismatches": len(tally.greedy_mismatches),
        "mismatch_samples": (tally.count_mismatches + tally.greedy_mismatches)[:5],
        "error_samples": tally.error_samples,
        "rss_bytes": {"samples": rss, "after_warmup_first": warm[0] if warm else 0,
                      "max": max((b for _, b in rss), default=0), "last": rss[-1][1] if rss else 0},
        "end": {"alive": alive, "state": end_state, "healthz": healthz, "exit_code": proc.returncode},
        "worker_log_tail": log_path.read_text(errors="replace").splitlines()[-5:],
    }


def markdown(doc: dict) -> str:
    mib = 1 << 20
    rss = doc["rss_bytes"]
    growth = (rss["last"] - rss["after_warmup_first"]) / mib
    errors = {k: v for k, v in doc["outcomes"].items() if k not in ("OK", "CANCELLED_BY_CLIENT")}
    lines = [
        f"# Soak: {doc['duration_seconds']:.0f} s of mixed load on one worker",
        "",
        f"- date: {doc['date']}",
        f"- machine: {doc['machine']}",
        f"- commit: {doc['commit']}",
        f"- command: `{doc['command']}`",
        f"- worker: `{doc['worker_command']}`",
        "",
        "| measure | value |",
        "|---|---|",
        f"| requests (concurrency {doc['concurrency']}) | {doc['requests']} |",
        f"| completed OK | {doc['outcomes'].get('OK', 0)} |",
        f"| cancelled by the client | {doc['outcomes'].get('CANCELLED_BY_CLIENT', 0)} |",
        f"| errors by status | {json.dumps(errors) if errors else 'none'} |",
        f"| policy pushes | {json.dumps(doc['policy_pushes'])} |",
        f"| tokens streamed | {doc['tokens_streamed']} |",
        f"| streams whose token count differs from generated_tokens | {doc['token_count_mismatches']} |",
        f"| greedy repeats checked / differing | {doc['greedy_checked']} / {doc['greedy_mismatches']} |",
        f"| worker VmRSS after warm-up / max / last (MiB) | {rss['after_warmup_first'] / mib:.0f} / "
        f"{rss['max'] / mib:.0f} / {rss['last'] / mib:.0f} (growth {growth:+.1f}) |",
        f"| at the end: alive, state, /healthz | {doc['end']['alive']}, {doc['end']['state']}, "
        f"{doc['end']['healthz']} |",
        f"| exit code after SIGTERM | {doc['end']['exit_code']} |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--concurrency", type=int, default=12, help="client streams kept in flight")
    parser.add_argument("--cancel-rate", type=float, default=0.15)
    parser.add_argument("--policy-interval", type=float, default=5.0)
    parser.add_argument("--rss-interval", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before RSS growth is counted")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--machine", default="", help="how to describe the machine in the results")
    parser.add_argument("--write", action="store_true", help="write bench/results/soak-<device>.{json,md}")
    args = parser.parse_args()
    doc = soak(args)
    table = markdown(doc)
    print(table)
    if args.write:
        name = f"soak-{args.device.split(':')[0]}"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        (RESULTS / f"{name}.md").write_text(table)
    bad = (doc["token_count_mismatches"] or doc["greedy_mismatches"] or not doc["end"]["alive"]
           or any(k not in ("OK", "CANCELLED_BY_CLIENT", "RESOURCE_EXHAUSTED") for k in doc["outcomes"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
