"""The refused-request flood of issue 22 (defect 1) against a real worker, engine core apart or not.

A worker serves a model directory with a ``tokenizer.json``; 8 streams generate while a flood
client loops ``Generate(prompt_text="a" * 1 MiB, max_new_tokens=1)``, each refused with
INVALID_ARGUMENT after the API layer tokenized it. A health client checks the inference service
every 0.25 s with a 1 s deadline, as a kubelet probe would. Each mode (``apart``: the engine core
in its own process, the default; ``inproc``: ``--no-engine-process``) runs a quiet phase and an
attacked phase on the same worker; the figures are the streams' tokens/s in each, their ratio,
the longest gap between two token messages of a stream, the health checks answered and failed,
and what a refusal cost the flood client.

``--table`` (issue 37) runs each attack of ``bench/attacks.py`` (idle HTTP/2 connections, idle
HTTP sockets, slowloris, bodies that made 500s, unparseable requests, an oversized ``Expect``, a
gzip bomb, the refused-prompt flood) from a client pinned to the last CPU, once against the
worker and once against a trivial sink server on the same machine, beside a quiet phase: the
others' tokens/s ratio under the attack on the sink is what the machine itself loses to the
attacking client, so the gap between the two ratios is the worker's own. Each row also has what
the attack got (answers by code), the probes answered (``/readyz`` and gRPC health, new
connections, 1 s deadlines), the log the worker wrote and its API process's RSS after it.

Every client is a process of its own (streams: one process, a thread per stream; health; flood),
never a thread inside the worker. The worker's torch runs one thread (``OMP_NUM_THREADS=1``) so
that the figures measure the interpreter lock, not a CPU oversubscribed by torch's pool.

    python bench/attack_bench.py --out bench/results/attack-cpu.json
    python bench/attack_bench.py --table --seconds 8 --out bench/results/attack-table-cpu.json \
        --markdown bench/results/attack-table-cpu.table.md --rss-floods 5   # issue 37's attack table
    python bench/attack_bench.py --modes apart --seconds 5          # the fixed worker alone
    git archive 5ca734f | tar -x -C /tmp/before && pip install --no-deps --target /tmp/beforepkg /tmp/before
    python bench/attack_bench.py --modes apart,inproc,before --before-pythonpath /tmp/beforepkg
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ports import free_port  # noqa: E402  (tests/ports.py: below the ephemeral range, never handed out twice)

INFERENCE = "graphkeeper.worker.v1.InferenceWorker"
#: ``--table``'s attacks (bench/attacks.py), in order.
ATTACK_NAMES = ("idle_h2", "idle_http", "slowloris", "bad_bodies", "unparseable", "expect_oversize", "gzip_bomb",
                "refused_prompts")
WORKER_FLAGS = ("--max-num-seqs", "8", "--max-seq-len", "512", "--max-num-batched-tokens", "64",
                "--max-queue", "64", "--log-level", "WARNING", "--drain-seconds", "5")
CORPUS = ["the graphs replay every decode step", "kubernetes operator reconciles the policy",
          "café crème brûlée — naïve façade"] * 20


def text_model(root: Path) -> Path:
    """random:tiny saved as a model directory, with a small byte-level BPE ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from graphkeeper.worker.model.loader import load_model, save_hf_directory

    save_hf_directory(load_model("random:tiny", device="cpu", max_positions=512).model, root)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return root


#: The ports of the last worker started (``start_worker``): the table's attacks need all of them.
PORTS: dict[str, int] = {}


def start_worker(model: Path, mode: str, log_path: Path, before: str = "",
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """``apart`` and ``inproc``: this checkout's worker with and without ``--engine-process``;
    ``before``: an older checkout's worker, installed at ``before`` (it predates the flag)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    PORTS.update(grpc=port, control=free_port(), metrics=free_port(), http=free_port())
    cmd = [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", str(model), "--device", "cpu",
           "--port", str(port), "--control-port", str(PORTS["control"]), "--metrics-port", str(PORTS["metrics"]),
           "--http-port", str(PORTS["http"]), *WORKER_FLAGS, *extra]
    if mode != "before":
        cmd.append("--engine-process" if mode == "apart" else "--no-engine-process")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if mode == "before":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (before, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    target = f"127.0.0.1:{port}"
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited during startup:\n{log_path.read_text()[-3000:]}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE), timeout=2).status == 1:
                return proc, target
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    raise RuntimeError("worker did not become ready")


# --- the client processes (spawned; each returns its figures through a queue) ----------------------


def streams_client(target: str, streams: int, seconds: float, out: mp.Queue) -> None:
    """``streams`` threads, each generating back to back; the token arrival times of each."""
    import grpc

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pb_grpc

    stub = pb_grpc.InferenceWorkerStub(grpc.insecure_channel(target))
    end = time.monotonic() + seconds
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(streams)]
    errors: list[str] = []

    def run(i: int) -> None:
        req = pb.GenerateRequest(prompt_token_ids=[5 + i, 6, 7, 8], stopping=pb.StoppingCriteria(
            max_new_tokens=200, ignore_eos=True))
        while time.monotonic() < end:
            try:
                for msg in stub.Generate(req, timeout=max(1.0, end - time.monotonic() + 30)):
                    if msg.HasField("tokens"):
                        arrivals[i].append((time.monotonic(), len(msg.tokens.token_ids)))
                    if time.monotonic() >= end:
                        break
            except grpc.RpcError as err:
                errors.append(err.code().name)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("streams", {"arrivals": arrivals, "errors": errors}))


def health_client(target: str, seconds: float, out: mp.Queue) -> None:
    """A probe every 0.25 s with a 1 s deadline: (latency or None when it failed) for each."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    end = time.monotonic() + seconds
    checks: list[float | None] = []
    while time.monotonic() < end:
        began = time.monotonic()
        try:
            ok = stub.Check(health_pb2.HealthCheckRequest(service=INFERENCE), timeout=1.0).status == 1
            checks.append(time.monotonic() - began if ok else None)
        except grpc.RpcError:
            checks.append(None)
        time.sleep(max(0.0, 0.25 - (time.monotonic() - began)))
    out.put(("health", checks))


def flood_client(target: str, seconds: float, text_bytes: int, out: mp.Queue) -> None:
    """Refused requests back to back (gzip on the wire): each one's status and latency."""
    import grpc

    from graphkeeper.proto import worker_pb2 as pb
    from graphkeeper.proto import worker_pb2_grpc as pb_grpc

    stub = pb_grpc.InferenceWorkerStub(grpc.insecure_channel(target))
    req = pb.GenerateRequest(prompt_text="a" * text_bytes, stopping=pb.StoppingCriteria(max_new_tokens=1))
    end = time.monotonic() + seconds
    sent: list[tuple[str, float]] = []
    while time.monotonic() < end:
        began = time.monotonic()
        try:
            for _ in stub.Generate(req, timeout=30, compression=grpc.Compression.Gzip):
                pass
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        sent.append((code, time.monotonic() - began))
    out.put(("flood", sent))


# --- one phase, one mode ---------------------------------------------------------------------------


def stream_figures(arrivals: list[list[tuple[float, int]]], begin: float, end: float) -> dict:
    """Tokens/s over [begin, end) and the longest gap between two messages of one stream."""
    tokens = sum(n for stream in arrivals for t, n in stream if begin <= t < end)
    gaps = [b[0] - a[0] for stream in arrivals for a, b in zip(stream, stream[1:], strict=False)
            if begin <= a[0] < end]
    return {"tokens_per_s": round(tokens / (end - begin), 1), "max_gap_s": round(max(gaps, default=0.0), 3)}


def phase(target: str, seconds: float, streams: int, flood_bytes: int) -> dict:
    """Streams and health for ``seconds`` (+2 s warm-up), with the flood when ``flood_bytes``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    warm = 2.0  # the clients' imports and first requests
    procs = [ctx.Process(target=streams_client, args=(target, streams, seconds + warm, out)),
             ctx.Process(target=health_client, args=(target, seconds + warm, out))]
    if flood_bytes:
        procs.append(ctx.Process(target=flood_client, args=(target, seconds + warm, flood_bytes, out)))
    began = time.monotonic()
    for p in procs:
        p.start()
    results = dict(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join(30)
    s = results["streams"]
    # Measured from the warm-up's end (the clients' monotonic clocks are this machine's one clock).
    figures = stream_figures(s["arrivals"], began + warm, began + warm + seconds)
    checks = results["health"]
    answered = [c for c in checks if c is not None]
    figures |= {"stream_errors": len(s["errors"]), "health_checks": len(checks),
                "health_failed": len(checks) - len(answered),
                "health_max_s": round(max(answered, default=0.0), 3)}
    if flood_bytes:
        sent = results["flood"]
        codes: dict[str, int] = {}
        for code, _ in sent:
            codes[code] = codes.get(code, 0) + 1
        figures |= {"refusals": codes, "refusal_mean_s": round(sum(t for _, t in sent) / max(1, len(sent)), 3)}
    return figures


def run_mode(model: Path, mode: str, args: argparse.Namespace, logs: Path) -> dict:
    """Quiet and attacked phases alternated ``rounds`` times on one worker (a shared machine's
    load drifts; alternating spreads the drift over both), then summed."""
    proc, target = start_worker(model, mode, logs / f"worker-{mode}.log", args.before_pythonpath)
    rounds = []
    try:
        for _ in range(args.rounds):
            rounds.append({"quiet": phase(target, args.seconds, args.streams, 0),
                           "attacked": phase(target, args.seconds, args.streams, args.attack_bytes),
                           "load_average": os.getloadavg()[0]})
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    summary = {}
    for kind in ("quiet", "attacked"):
        phases = [r[kind] for r in rounds]
        summary[kind] = {
            "tokens_per_s": round(sum(p["tokens_per_s"] for p in phases) / len(phases), 1),
            "max_gap_s": max(p["max_gap_s"] for p in phases),
            "health_checks": sum(p["health_checks"] for p in phases),
            "health_failed": sum(p["health_failed"] for p in phases),
            "health_max_s": max(p["health_max_s"] for p in phases),
            "stream_errors": sum(p["stream_errors"] for p in phases),
        }
    quiet, attacked = summary["quiet"]["tokens_per_s"], summary["attacked"]["tokens_per_s"]
    return {**summary, "throughput_ratio": round(attacked / quiet, 3) if quiet else 0.0, "exit_code": code,
            "rounds": rounds}


# --- the attack table (issue 37) ------------------------------------------------------------------


def attack_client(name: str, ports: dict, seconds: float, cpu: int | None, out: mp.Queue) -> None:
    """One attack of ``attacks.ATTACKS`` from a process pinned to ``cpu`` where the OS allows."""
    import attacks

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    out.put(("attack", attacks.ATTACKS[name](ports, seconds)))


def probe_client(ports: dict, seconds: float, out: mp.Queue) -> None:
    """The kubelet's view, every 0.25 s with 1 s deadlines: /readyz on the metrics port on a new
    connection, and gRPC health of the inference service on a new channel."""
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + seconds
    readyz = health = checks = 0
    while time.monotonic() < end:
        began = time.monotonic()
        checks += 1
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/readyz", timeout=1.0) as resp:
                readyz += resp.status == 200
        except OSError:
            pass
        try:
            with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
                health += health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=INFERENCE), timeout=1.0).status == 1
        except grpc.RpcError:
            pass
        time.sleep(max(0.0, 0.25 - (time.monotonic() - began)))
    out.put(("probe", {"checks": checks, "readyz_ok": readyz, "health_ok": health}))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def table_phase(target: str, ports: dict, seconds: float, streams: int, attack: str = "",
                attack_ports: dict | None = None, cpu: int | None = None) -> dict:
    """Streams and probes on the worker for ``seconds`` (+2 s warm-up); with ``attack`` aimed at
    ``attack_ports`` (the worker's, or the sink's)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    warm = 2.0
    procs = [ctx.Process(target=streams_client, args=(target, streams, seconds + warm, out)),
             ctx.Process(target=probe_client, args=(ports, seconds + warm, out))]
    if attack:
        procs.append(ctx.Process(target=attack_client, args=(attack, attack_ports, seconds + warm, cpu, out)))
    began = time.monotonic()
    for p in procs:
        p.start()
    results = dict(out.get(timeout=seconds + 180) for _ in procs)
    for p in procs:
        p.join(30)
    figures = stream_figures(results["streams"]["arrivals"], began + warm, began + warm + seconds)
    figures |= {"stream_errors": len(results["streams"]["errors"]), **results["probe"]}
    if attack:
        figures |= results["attack"]
    return figures


def run_table(model: Path, args: argparse.Namespace, logs: Path) -> dict:
    """Each attack against the worker and against a trivial sink server, beside a quiet phase,
    on one worker: the others' tokens/s ratio under each, what the attack got, the probes answered,
    the worker's RSS and the log it wrote."""
    import attacks

    proc, target = start_worker(model, "apart", logs / "worker-table.log", extra=tuple(args.worker_flags.split()))
    ports = {**PORTS, "bomb": str(logs / "bomb.gz")}
    attacks.write_bomb(ports["bomb"])
    ctx = mp.get_context("spawn")
    sink_ports = {"grpc": free_port(), "http": free_port(), "bomb": ports["bomb"]}
    ready = ctx.Event()
    sink = ctx.Process(target=attacks.sink_server, args=(sink_ports, ready), daemon=True)
    sink.start()
    ready.wait(60)
    cpu = (os.cpu_count() or 1) - 1 if (os.cpu_count() or 1) > 1 else None
    rows = []
    log_file = logs / "worker-table.log"
    try:
        for name in args.attacks.split(","):
            quiet = table_phase(target, ports, args.seconds, args.streams)
            log_before = log_file.stat().st_size
            worker = table_phase(target, ports, args.seconds, args.streams, name, ports, cpu)
            log_bytes = log_file.stat().st_size - log_before
            rss = rss_mb(proc.pid)
            sunk = table_phase(target, ports, args.seconds, args.streams, name, sink_ports, cpu)
            row = {"attack": name, "requests": worker["requests"], "answers": worker["answers"],
                   "probes": worker["checks"], "readyz_ok": worker["readyz_ok"], "health_ok": worker["health_ok"],
                   "quiet_tokens_per_s": quiet["tokens_per_s"], "attacked_tokens_per_s": worker["tokens_per_s"],
                   "ratio": round(worker["tokens_per_s"] / quiet["tokens_per_s"], 3) if quiet["tokens_per_s"] else 0,
                   "sink_tokens_per_s": sunk["tokens_per_s"],
                   "sink_ratio": round(sunk["tokens_per_s"] / quiet["tokens_per_s"], 3) if quiet["tokens_per_s"] else 0,
                   "sink_requests": sunk["requests"], "sink_answers": sunk["answers"],
                   "max_gap_s": worker["max_gap_s"], "stream_errors": worker["stream_errors"],
                   "worker_log_bytes": log_bytes, "api_rss_mb": rss, "load_average": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        sink.kill()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    return {"rows": rows, "exit_code": code, "attacker_cpu": cpu}


def run_rss(model: Path, args: argparse.Namespace, logs: Path) -> dict:
    """Repeated floods of the refused-prompt attack on one worker: its API process's RSS after
    each (it grew 870 -> 1,122 MB over five 30 s floods in issue 37)."""
    proc, _ = start_worker(model, "apart", logs / "worker-rss.log")
    ctx = mp.get_context("spawn")
    rss = {"start": rss_mb(proc.pid), "after_flood": [], "refusals": []}
    try:
        for _ in range(args.rss_floods):
            out = ctx.Queue()
            flood = ctx.Process(target=attack_client, args=("refused_prompts", dict(PORTS), args.seconds, None, out))
            flood.start()
            result = out.get(timeout=args.seconds + 120)[1]
            flood.join(30)
            time.sleep(2.0)
            rss["after_flood"].append(rss_mb(proc.pid))
            rss["refusals"].append(result["answers"])
            print("rss", rss["after_flood"][-1], result["answers"], flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return rss


def markdown_table(rows: list[dict]) -> str:
    """The attack table as Markdown."""
    lines = ["| attack | requests | answers | probes answered (/readyz, gRPC health) | others' tokens/s "
             "(quiet -> attacked) | ratio | ratio, attack on the sink | log written | API RSS |",
             "|---|---:|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["answers"].items()))
        lines.append(f"| {r['attack']} | {r['requests']} | {answers} | {r['readyz_ok']}/{r['probes']}, "
                     f"{r['health_ok']}/{r['probes']} | {r['quiet_tokens_per_s']:,.0f} -> "
                     f"{r['attacked_tokens_per_s']:,.0f} | {r['ratio']:.2f} | {r['sink_ratio']:.2f} | "
                     f"{r['worker_log_bytes'] / 1024:.1f} KB | {r['api_rss_mb']:.0f} MB |")
    return "\n".join(lines)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GRAPHKEEPER_COMMIT", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="apart,inproc",
                        help="apart (engine core in its own process), inproc (--no-engine-process), before")
    parser.add_argument("--before-pythonpath", default="",
                        help="mode 'before': an older checkout installed here (pip install --target DIR)")
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per phase")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="quiet/attacked phase pairs per mode")
    parser.add_argument("--attack-bytes", type=int, default=1 << 20, help="prompt_text length of each refused request")
    parser.add_argument("--out", default="")
    parser.add_argument("--table", action="store_true",
                        help="issue 37's attack table: each attack on the worker and on a trivial sink server")
    parser.add_argument("--attacks", default=",".join(ATTACK_NAMES), help="the table's attacks, in order")
    parser.add_argument("--markdown", default="", help="--table: also write the table as Markdown here")
    parser.add_argument("--worker-flags", default="",
                        help="--table: more worker flags, e.g. '--header-timeout 3 --connection-idle-seconds 5'")
    parser.add_argument("--rss-floods", type=int, default=0,
                        help="first, this many refused-prompt floods of --seconds (the API process's RSS after each)")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="attack-bench-"))
    model = text_model(logs / "model")
    if args.table or args.rss_floods:
        main_table(args, model, logs)
        return
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "before": args.before_pythonpath and "the worker installed at --before-pythonpath",
        "workload": {"streams": args.streams, "max_new_tokens": 200, "attack_bytes": args.attack_bytes,
                     "worker_flags": list(WORKER_FLAGS), "seconds": args.seconds,
                     "rounds": args.rounds},
        "load_average_before": os.getloadavg()[0],
        "modes": {},
    }
    for mode in args.modes.split(","):
        result["modes"][mode] = run_mode(model, mode, args, logs)
        brief = {k: v for k, v in result["modes"][mode].items() if k != "rounds"}
        print(mode, json.dumps(brief), flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


def main_table(args: argparse.Namespace, model: Path, logs: Path) -> None:
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workload": {"streams": args.streams, "max_new_tokens": 200,
                     "worker_flags": [*WORKER_FLAGS, *args.worker_flags.split()],
                     "seconds": args.seconds},
        "load_average_before": os.getloadavg()[0],
    }
    if args.rss_floods:
        result["rss_mb"] = run_rss(model, args, logs)
    if args.table:
        result |= run_table(model, args, logs)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.markdown and args.table:
        Path(args.markdown).write_text(markdown_table(result["rows"]) + "\n")
    print(markdown_table(result.get("rows", [])))


if __name__ == "__main__":
    main()
