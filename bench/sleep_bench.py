"""Sleep and wake on a GPU, through a real worker process over gRPC: what a sleep gives back of the
device memory the worker holds, how long a woken worker takes to its first token, and whether it
comes back as it was (the same greedy tokens, the same captured graphs, no recapture).

Issue Startup II's acceptance, which this bench is set against: a sleep frees at least 90% of the
worker's device memory (level 1); wake to first token at most 1 s for llama-1b and 2 s for llama-8b;
0 recaptures; the greedy tokens after the wake equal those before; a request sent to a sleeping
worker is answered.

For each preset, one worker (``--enable-sleep-mode``, a fixed KV cache budget) is started and
greedy tokens of a few short prompts are taken (each prompt alone: the same step shapes every
time). Device memory is the driver's view (``torch.cuda.mem_get_info`` in this process, every
process counted) less what was in use before the worker started: this process's own CUDA context
cancels out. Then for each level: Sleep (its RPC's own seconds, the share of the held memory it
gave back), a greedy request sent to the sleeping worker (the wake a request makes: from sending it
to its first token, as a client sees it), the other prompts, and the worker compared with itself
before the sleep: tokens, captured graphs and each one's capture time, ``total_capture_seconds``,
``graphkeeper_recaptures_total`` and ``graphkeeper_wakes_total{cause="request"}``. At level 1 the
worker is then put to sleep once more and woken by an explicit ``Wake`` (its seconds, then a greedy
request's first token) as a second figure. The issue names no level for the wake target: it is
judged at every level (``WAKE_TARGET_LEVELS``).

The JSON report is written after each preset, so a run cut short keeps what it measured.

    python bench/sleep_bench.py --out bench/results/sleep-h200.json
    python bench/sleep_bench.py --device cpu --presets tiny --out /tmp/sleep-cpu.json  # the bench's own smoke

On a CPU the worker refuses Sleep (FAILED_PRECONDITION): the refusal is reported in the row and the
rest runs on an awake worker, which checks the bench's code paths and nothing about sleep.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from load_bench import _commit, free_port  # noqa: E402
from metrics_text import fetch, value  # noqa: E402
from start_bench import default_presets, process_started, ready_now  # noqa: E402

from graphkeeper.proto import worker_pb2 as pb  # noqa: E402
from graphkeeper.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

#: Llama 3 token ids (BOS first), shorter than a KV block (16 tokens): no prefix-cache hit changes a
#: prefill's shape between the runs compared, so greedy tokens compare exactly (as tests/gpu's).
#: A smaller vocabulary (tiny) takes each id modulo its size.
PROMPTS = ((128000, 791, 6864, 315, 9822), (128000, 40, 1093, 311, 3137, 922, 279, 9282, 3432),
           (128000, 16, 11, 220, 17, 11, 220, 18, 11, 220, 19, 11, 220))
NEW_TOKENS = 24
#: The issue's targets: the share of the held device memory a sleep gives back (at these levels),
#: and the seconds from a request sent to a sleeping worker to its first token (at these levels).
RELEASED_SHARE_TARGET = 0.90
SHARE_TARGET_LEVELS = (1,)
WAKE_TARGETS = {"llama-1b": 1.0, "llama-8b": 2.0}
WAKE_TARGET_LEVELS = (1, 2)
#: Bounds on every call: a sleep or wake of llama-8b moves 16 GB; nothing else should take long.
SLEEP_TIMEOUT = 120.0
GENERATE_TIMEOUT = 120.0
QUICK_TIMEOUT = 10.0
RECAPTURE_CAUSES = ("policy", "model_revision")
GIB = 2**30



@dataclass
class Worker:
    """A started worker: its process, the channels of its inference and control ports, its metrics
    port (``/readyz``, ``/metrics``) and log."""

    proc: subprocess.Popen
    inference: pb_grpc.InferenceWorkerStub
    control: pb_grpc.GraphControlStub
    metrics_port: int
    log_path: Path
    channels: list[grpc.Channel] = field(default_factory=list)

    def status(self) -> pb.GraphStatus:
        return self.control.GetGraphStatus(pb.GetGraphStatusRequest(), timeout=QUICK_TIMEOUT)

    def metrics_text(self) -> str:
        return fetch(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def readyz(self) -> tuple[int, str]:
        """``/readyz``'s status and body: 200 "SLEEPING" while asleep (a request still wakes it)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz",
                                        timeout=QUICK_TIMEOUT) as reply:
                return reply.status, reply.read().decode().strip()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode().strip()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a minute: no request runs, so it should exit at once."""
        for channel in self.channels:
            channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class Generation:
    """One greedy request's tokens, the client's seconds from sending it to its first token, and
    how many of its steps replayed a graph."""

    tokens: list[int]
    first_token_seconds: float
    graph_steps: int


# --- the worker ---------------------------------------------------------------------------------


def worker_command(model: str, args: argparse.Namespace, ports: tuple[int, int, int], cache_dir: str) -> list[str]:
    """The worker's command line: sleep mode, a fixed KV cache budget, the sizes of a served worker."""
    port, control, metrics = ports
    return [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", model, "--device", args.device,
            "--dtype", args.dtype, "--port", str(port), "--control-port", str(control), "--metrics-port",
            str(metrics), "--http-port", "0", "--enable-sleep-mode", "--kv-cache-memory", args.kv_cache_memory,
            "--max-num-seqs", str(args.max_num_seqs), "--max-seq-len", str(args.max_seq_len),
            "--compile-cache-dir", cache_dir, "--log-level", "INFO", *args.worker_args.split()]


def start_worker(model: str, args: argparse.Namespace, cache_dir: str, log_path: Path) -> tuple[Worker, float]:
    """A worker process, once ``/readyz`` answers 200; and its seconds from process start to READY."""
    ports = (free_port(), free_port(), free_port())
    with log_path.open("w") as log:
        proc = subprocess.Popen(worker_command(model, args, ports, cache_dir), stdout=log, stderr=subprocess.STDOUT)
    began = process_started(proc.pid)
    while not ready_now(ports[2]):
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited during startup:\n{log_path.read_text()[-3000:]}")
        if time.time() - began > args.start_timeout:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"worker not READY in {args.start_timeout:.0f} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    ready = time.time() - began
    inference, control = grpc.insecure_channel(f"127.0.0.1:{ports[0]}"), grpc.insecure_channel(f"127.0.0.1:{ports[1]}")
    worker = Worker(proc, pb_grpc.InferenceWorkerStub(inference), pb_grpc.GraphControlStub(control), ports[2],
                    log_path, [inference, control])
    return worker, ready


def generate(worker: Worker, prompt: list[int]) -> Generation:
    """One greedy request over a streaming call, timed from sending it to its first token."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0.0),
                                 stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    tokens: list[int] = []
    first = 0.0
    completion = None
    sent = time.perf_counter()
    for response in worker.inference.Generate(request, timeout=GENERATE_TIMEOUT):
        if response.HasField("tokens"):
            if not tokens and response.tokens.token_ids:
                first = time.perf_counter() - sent
            tokens.extend(response.tokens.token_ids)
        else:
            completion = response.completion
    if completion is None:
        raise RuntimeError("the stream ended without a completion")
    return Generation(tokens, first, sum(g.steps for g in completion.execution.graph_steps))


def greedy(worker: Worker, prompts: list[list[int]]) -> list[Generation]:
    """Each prompt alone, in order: the same step shapes every time."""
    return [generate(worker, prompt) for prompt in prompts]


# --- what is compared -------------------------------------------------------------------------------


def used_bytes(device: str) -> int | None:
    """Device memory in use on the GPU, every process counted (the driver's view); None on a CPU."""
    if device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def graphs(status: pb.GraphStatus) -> list[tuple[int, int, float]]:
    """The captured graphs and each one's capture time: a recapture would change the time."""
    return sorted((c.mode, c.size, c.capture_seconds) for c in status.captured if not c.released)


def recaptures(text: str) -> float:
    return sum(value(text, "graphkeeper_recaptures_total", cause=c) for c in RECAPTURE_CAUSES)


def refusal(err: grpc.RpcError) -> dict:
    """A refused or failed call, as the row reports it."""
    return {"code": err.code().name, "details": err.details()}


def gib(n: int | None) -> float | None:
    return None if n is None else n / GIB


# --- one level --------------------------------------------------------------------------------------


def sleep(worker: Worker, level: int, row: dict, prefix: str = "") -> bool:
    """Sleep at ``level``, its seconds (the client's and the worker's own) into ``row``; False (the
    refusal in ``row``) when the worker refuses it, as a CPU worker does."""
    began = time.perf_counter()
    try:
        slept = worker.control.Sleep(pb.SleepRequest(level=level), timeout=SLEEP_TIMEOUT)
    except grpc.RpcError as err:
        row[f"{prefix}sleep_refused"] = refusal(err)
        return False
    row[f"{prefix}sleep_seconds"] = time.perf_counter() - began
    row[f"{prefix}sleep_worker_seconds"] = slept.seconds
    row[f"{prefix}sleep_released_bytes_reported"] = slept.released_bytes
    row[f"{prefix}already_asleep"] = slept.already_asleep
    row[f"{prefix}context_offloaded"] = slept.context_offloaded
    row[f"{prefix}context_note"] = slept.context_note
    return True


def measure_asleep(worker: Worker, level: int, baseline: int | None, held: int | None, device: str,
                   awake: pb.GraphStatus) -> dict:
    """What a sleeping worker holds and reports: the memory it gave back, its state, its graphs."""
    used = used_bytes(device)
    still = None if used is None or baseline is None else used - baseline
    status = worker.status()
    code, body = worker.readyz()
    return {"released_bytes": None if still is None or held is None else held - still,
            "share": released_share(held, still), "state_asleep": pb.LifecycleState.Name(status.state),
            "sleeping": status.state == pb.LIFECYCLE_STATE_SLEEPING and status.sleep.level == level,
            "readyz_asleep": f"{code} {body}", "graphs_kept_asleep": graphs(status) == graphs(awake),
            "sleeping_gauge": value(worker.metrics_text(), "graphkeeper_sleeping")}


def released_share(held: int | None, still: int | None) -> float | None:
    """The share of the held device memory a sleep gave back (pure)."""
    if held is None or still is None or held <= 0:
        return None
    return (held - still) / held


def compare_awake(worker: Worker, awake: pb.GraphStatus, metrics_before: str) -> dict:
    """The woken worker against itself before the sleep: its graphs, capture seconds, recaptures."""
    status = worker.status()
    text = worker.metrics_text()
    return {"state_woken": pb.LifecycleState.Name(status.state), "graphs": len(graphs(status)),
            "graphs_kept": graphs(status) == graphs(awake),
            "capture_seconds_kept": status.total_capture_seconds == awake.total_capture_seconds,
            "recaptures": recaptures(text) - recaptures(metrics_before),
            "last_wake_worker_seconds": status.sleep.last_wake_seconds}


def request_wake(worker: Worker, prompts: list[list[int]], before: list[list[int]]) -> dict:
    """The prompts sent to the sleeping worker, the first one waking it (as a client sees it)."""
    after = greedy(worker, prompts)
    return {"wake_to_first_token_seconds": after[0].first_token_seconds, "answered": bool(after[0].tokens),
            "tokens_equal": [g.tokens for g in after] == before,
            "graph_steps_after_wake": sum(g.graph_steps for g in after)}


def explicit_wake(worker: Worker, prompts: list[list[int]], before: list[list[int]]) -> dict:
    """Level 1 again, woken by a Wake call this time: its seconds, then a greedy request's first token.
    A refused sleep (a CPU) still calls Wake, which an awake worker answers with was_asleep false: the
    figures then say nothing of a wake, but the bench's own path is run."""
    row: dict = {}
    sleep(worker, 1, row, prefix="explicit_")
    began = time.perf_counter()
    try:
        woke = worker.control.Wake(pb.WakeRequest(), timeout=SLEEP_TIMEOUT)
    except grpc.RpcError as err:
        row["wake_refused"] = refusal(err)
        return row
    row.update(wake_rpc_seconds=time.perf_counter() - began, wake_rpc_worker_seconds=woke.seconds,
               wake_rpc_was_asleep=woke.was_asleep, wake_rpc_restored_bytes=woke.restored_bytes)
    after = greedy(worker, prompts)
    row.update(first_token_after_wake_rpc_seconds=after[0].first_token_seconds,
               tokens_equal_after_wake_rpc=[g.tokens for g in after] == before)
    return row


def measure_level(worker: Worker, level: int, prompts: list[list[int]], before: list[list[int]],
                  baseline: int | None, device: str, explicit: bool) -> dict:
    """One level: sleep, a request that wakes the worker, and the worker compared with itself before."""
    awake = worker.status()
    metrics_before = worker.metrics_text()
    used = used_bytes(device)
    held = None if used is None or baseline is None else used - baseline
    row: dict = {"level": level, "held_bytes": held, "graphs_before": len(graphs(awake))}
    if sleep(worker, level, row):
        row.update(measure_asleep(worker, level, baseline, held, device, awake))
    try:
        row.update(request_wake(worker, prompts, before))
    except grpc.RpcError as err:  # the "a request sent to a sleeping worker is answered", not met
        row.update(request_error=refusal(err), answered=False, wake_to_first_token_seconds=None, tokens_equal=False,
                   graph_steps_after_wake=0)
    wakes = "graphkeeper_wakes_total"
    row["request_wakes"] = value(worker.metrics_text(), wakes, cause="request") - value(
        metrics_before, wakes, cause="request")
    if explicit:
        row.update(explicit_wake(worker, prompts, before))
    row.update(compare_awake(worker, awake, metrics_before))
    return row


# --- one preset ---------------------------------------------------------------------------------------


def run_preset(preset: str, args: argparse.Namespace, cache_dir: str, logs: Path) -> dict:
    """One worker of ``preset`` through every level; a call that fails ends the preset, its error kept."""
    baseline = used_bytes(args.device)  # this process's own context included, so it cancels out
    out: dict = {"preset": preset, "baseline_bytes": baseline, "levels": [], "log": str(logs / f"{preset}.log")}
    try:
        worker, out["seconds_to_ready"] = start_worker(f"random:{preset}", args, cache_dir, logs / f"{preset}.log")
    except RuntimeError as err:
        out["error"] = str(err)
        print(f"{preset}: {err}", flush=True)
        return out
    try:
        vocab = worker.inference.GetModelInfo(pb.GetModelInfoRequest(), timeout=QUICK_TIMEOUT).vocab_size
        prompts = [[t % vocab for t in p] for p in PROMPTS]
        before = [g.tokens for g in greedy(worker, prompts)]
        for level in (int(x) for x in args.levels.split(",")):
            row = measure_level(worker, level, prompts, before, baseline, args.device, explicit=level == 1)
            row.update(preset=preset, **targets(preset, row))
            out["levels"].append(row)
            print(summary_line(row), flush=True)
    except (grpc.RpcError, RuntimeError) as err:
        out["error"] = refusal(err) if isinstance(err, grpc.RpcError) else str(err)
        print(f"{preset}: stopped by {out['error']}", flush=True)
    finally:
        worker.stop()
    return out


# --- judging and reporting (pure) -------------------------------------------------------------------


def targets(preset: str, row: dict) -> dict:
    """Whether the row meets the issue's targets: None where a target does not apply or nothing was
    measured (a refused sleep, a CPU, a preset the issue names no target for)."""
    share, first = row.get("share"), row.get("wake_to_first_token_seconds")
    share_met = share >= RELEASED_SHARE_TARGET if share is not None and row["level"] in SHARE_TARGET_LEVELS else None
    limit = WAKE_TARGETS.get(preset)
    asleep = "sleep_refused" not in row
    judged = limit is not None and asleep and row["level"] in WAKE_TARGET_LEVELS
    wake_met = (first is not None and first <= limit) if judged else None  # no first token: not answered, not met
    return {"share_target": RELEASED_SHARE_TARGET if share_met is not None else None, "share_met": share_met,
            "wake_target_seconds": limit if wake_met is not None else None, "wake_met": wake_met,
            "no_recapture": row.get("recaptures") == 0, "tokens_equal_all": row.get("tokens_equal") is True
            and row.get("tokens_equal_after_wake_rpc", True) is True}


def summary_line(row: dict) -> str:
    """One printed line for a level (pure)."""
    if "sleep_refused" in row:
        slept = f"sleep refused ({row['sleep_refused']['code']}: {row['sleep_refused']['details']})"
    else:
        slept = (f"held {_num(gib(row['held_bytes']), 2)} GiB, released {_num(gib(row.get('released_bytes')), 2)} "
                 f"GiB (share {_num(row.get('share'), 3)}; context offloaded {_offloaded(row)}) in "
                 f"{row['sleep_seconds']:.2f} s, {row['state_asleep']}")
    wake_rpc = ""
    if "wake_rpc_seconds" in row:
        wake_rpc = (f", Wake {row['wake_rpc_seconds']:.3f} s then first token "
                    f"{row['first_token_after_wake_rpc_seconds']:.3f} s")
    return (f"{row['preset']:<9} level {row['level']}: {slept}; wake to first token "
            f"{_num(row['wake_to_first_token_seconds'], 3)} s{wake_rpc}; tokens equal {row['tokens_equal_all']}, "
            f"request wakes {row['request_wakes']:.0f}, recaptures {row['recaptures']:.0f}, graphs kept "
            f"{row['graphs_kept']} ({row['graphs']})")


def table(rows: list[dict]) -> list[str]:
    """Markdown: one row per preset and level, the issue's targets judged in the last columns (pure)."""
    head = ("preset", "level", "held GiB", "released GiB", "share", "context offloaded", "sleep s",
            "wake to 1st token s (request)",
            "Wake RPC s", "1st token after Wake s", "tokens equal", "recaptures", "graphs kept",
            f"share >= {RELEASED_SHARE_TARGET:.2f}", "wake target")
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        refused = r.get("sleep_refused")
        slept = f"refused ({refused['code']})" if refused else _num(r.get("sleep_seconds"), 2)
        woken = _num(r.get("wake_rpc_seconds"), 3) + ("" if r.get("wake_rpc_was_asleep", True) else " (was awake)")
        cells = (r["preset"], str(r["level"]), _num(gib(r["held_bytes"]), 2), _num(gib(r.get("released_bytes")), 2),
                 _num(r.get("share"), 3), _offloaded(r), slept,
                 _num(r["wake_to_first_token_seconds"], 3), woken,
                 _num(r.get("first_token_after_wake_rpc_seconds"), 3), _yes(r["tokens_equal_all"]),
                 _zero(r["recaptures"]), _yes(r["graphs_kept"]), _met(r["share_met"]),
                 _met(r["wake_met"], f"<= {r['wake_target_seconds']:.0f} s" if r["wake_target_seconds"] else ""))
        out.append("| " + " | ".join(cells) + " |")
    return out


def _offloaded(row: dict) -> str:
    """Whether the sleep moved the CUDA context and graph memory to the host too, or why not (pure)."""
    if "context_offloaded" not in row:
        return "-"
    return "yes" if row["context_offloaded"] else f"no: {row.get('context_note', '')}"[:80]


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _yes(x: bool) -> str:
    return "yes" if x else "**no**"


def _zero(x: float) -> str:
    return f"{x:.0f}" if x == 0 else f"**{x:.0f}**"


def _met(x: bool | None, what: str = "") -> str:
    if x is None:
        return "-"
    text = f"{what} {'met' if x else 'not met'}".strip()
    return text if x else f"**{text}**"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="", help="default: llama-1b,llama-8b on a GPU, tiny on a CPU")
    parser.add_argument("--levels", default="1,2", help="sleep levels, in order, on the same worker")
    parser.add_argument("--device", default="cuda", help="cpu checks the bench itself (random:tiny), nothing more")
    parser.add_argument("--dtype", default="", help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--kv-cache-memory", default="",
                        help="KV cache budget (default: 24Gi on a GPU, 256Mi on a CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--worker-args", default="-O2", help="flags every worker gets (space-separated)")
    parser.add_argument("--compile-cache-dir", default="", help="default: a new temporary directory")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a worker may take to READY")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.presets = args.presets or default_presets(args.device)
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.kv_cache_memory = args.kv_cache_memory or ("24Gi" if cuda else "256Mi")
    import torch

    if cuda:
        torch.cuda.init()
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": _commit(),
              "targets": {"released_share": RELEASED_SHARE_TARGET, "share_levels": SHARE_TARGET_LEVELS,
                          "wake_to_first_token_seconds": WAKE_TARGETS, "wake_levels": WAKE_TARGET_LEVELS},
              "presets": [], "rows": []}
    cache = args.compile_cache_dir or tempfile.mkdtemp(prefix="compile-cache-")
    logs = Path(tempfile.mkdtemp(prefix="sleep-bench-"))
    try:
        for preset in args.presets.split(","):
            result = run_preset(preset, args, cache, logs)
            report["presets"].append({k: v for k, v in result.items() if k != "levels"})
            report["rows"] += result["levels"]
            report["table"] = table(report["rows"])
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if not args.compile_cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
    print("\n".join(report.get("table", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
