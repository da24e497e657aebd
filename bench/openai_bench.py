"""The OpenAI HTTP path against the gRPC path, with a standard benchmark client (GuideLLM).

The workload published serving numbers use: random prompts of ``--prompt-tokens`` (1,024) tokens,
``--output-tokens`` (128) new tokens with ``ignore_eos``, at each concurrency of ``--concurrency``
(1, 16, 64), for a random-weight model of a preset's shape (``llama-1b``, ``llama-8b``).

1. The model: ``random:<preset>`` saved as a Hugging Face directory with a word-level tokenizer
   that covers the model's whole vocabulary (``w0`` .. ``w<V-1>``, one word per token), so that
   GuideLLM can build text prompts of exact token counts and every token a random model generates
   decodes to text (a real tokenizer of another vocabulary would leave ids it does not know
   silent). Prompt text is tokenized and output detokenized by the worker, as for any text model.
2. HTTP: one worker (``--http-port``), GuideLLM's ``concurrent`` profile over ``/v1/completions``
   (streaming, usage in every chunk) for each concurrency, ``--seconds`` each; then, on the same
   worker, the plain multi-process client (``bench/http_client.py``: one process per core, nothing
   tokenized on the client) at the same concurrencies (``--clients``). Each client's CPU is
   recorded (GuideLLM's as the CPU time of its process tree over its run): a figure is the
   worker's only if its client was not the limit, which the plain client beside it shows.
3. gRPC: ``bench/load_bench.py`` on the same model directory with scenarios ``c<N>-p<P>-o<O>``
   (token-id prompts of the same lengths, ``ignore_eos``), ``--seconds`` each.
4. ``$OUT/openai-<preset>.json`` and ``.md``: tokens/s, TTFT and inter-token latency percentiles of
   every client and path, the clients' CPU, and the ratio HTTP / gRPC of tokens/s at each
   concurrency (the acceptance asks for >= 0.95 at 1, 16 and 64).

GuideLLM and what it needs beyond the GPU image (torch, transformers, numpy, protobuf are there),
aiohttp (the worker's HTTP server) included, are installed from carried wheels into ``--site``
(``pip install --no-index --no-deps --target``); every process started from here gets ``--site`` on
its ``PYTHONPATH``. ``bench/openai_bench_wheels.sh`` downloads them (the pinned list is
``bench/openai_bench_wheels.txt``): pyarrow (53 MiB, which GuideLLM's synthetic data needs through
``datasets``) in ``.benchwhl-a``, the rest (32 MiB) in ``.benchwhl-b``. On the GPU machine, two
calls on the same warm machine (``.benchsite`` is git-ignored and stays between them):

    # call 1, carrying .benchwhl-a
    python3 -m pip install -q --no-index --no-deps --no-compile --target .benchsite .benchwhl-a/*.whl
    # call 2, carrying .benchwhl-b and .whl (grpc health and reflection, as for every GPU session)
    TESTS=0 BENCH='python3 bench/openai_bench.py --preset llama-1b --site .benchsite --wheels .benchwhl-b \
        --models /tmp/obm --seconds 20 --out $out' bash bench/gpu_session.sh
    python bench/openai_bench.py --device cpu --dtype float32 --preset tiny --prompt-tokens 32 \\
        --output-tokens 8 --concurrency 2 --seconds 5 --site /tmp/glsite --out /tmp/ob           # CPU check
    python bench/openai_bench.py --device cpu --dtype float32 --preset tiny --prompt-tokens 32 \\
        --output-tokens 8 --concurrency 2 --seconds 3 --clients plain --out /tmp/ob  # no GuideLLM
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import http_client  # noqa: E402  (bench/http_client.py, beside this file)
from http_client import free_port, wait_ready  # noqa: E402

#: The token budget per step both workers get (load_bench.py's --budget, the HTTP worker's
#: --max-num-batched-tokens), and the same --max-num-seqs, so the two paths differ only in the API.
GRPC_BENCH_BUDGET = 512


def install_client(wheels: Path, site: Path) -> None:
    """GuideLLM and its closure from carried wheels, into ``site`` (no index, no dependency resolution:
    the wheels are the closure, the image provides the rest). Nothing to do when ``site`` already
    has them (installed by an earlier call, e.g. pyarrow alone: bench/openai_bench_wheels.sh)."""
    if (site / "guidellm").is_dir() and (site / "pyarrow").is_dir() and (site / "aiohttp").is_dir():
        return
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"no wheels in {wheels} and GuideLLM is not installed in {site}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *found], check=True)


def word_tokenizer(vocab: int, path: Path) -> None:
    """``tokenizer.json``: word ``w<i>`` is id ``i``, words split on whitespace, unknown words are
    ``w0``; decoding joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}))


def prepare_model(preset: str, device: str, dtype: str, root: Path, tokenizer=None, suffix: str = "") -> Path:
    """``random:<preset>``'s weights as a model directory with a tokenizer covering its vocabulary
    (made once): ``tokenizer(vocab, path)`` writes it, the word-level one by default."""
    path = root / f"{preset}-{dtype}{suffix}"
    if (path / "tokenizer.json").is_file():
        return path
    import torch

    from graphkeeper.worker.model.loader import load_model, save_hf_directory

    loaded = load_model(f"random:{preset}", device=device, dtype=dtype, max_positions=8192)
    save_hf_directory(loaded.model, path)
    vocab = loaded.config.vocab_size
    del loaded
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    (tokenizer or word_tokenizer)(vocab, path)
    return path


def start_worker(model: Path, args: argparse.Namespace, max_num_seqs: int, log: Path) -> tuple[subprocess.Popen, str]:
    http = free_port()
    cmd = [sys.executable, "-m", "graphkeeper.cli", "worker", "--model", str(model), "--device", args.device,
           "--dtype", args.dtype, "--port", str(free_port()), "--control-port", str(free_port()),
           "--metrics-port", "0", "--http-port", str(http), "--served-model-name", str(model),
           "--max-num-seqs", str(max_num_seqs), "--max-seq-len", str(args.max_seq_len), "--max-queue", "4096",
           "--max-num-batched-tokens", str(GRPC_BENCH_BUDGET),
           "--log-level", "WARNING", *args.worker_args.split()]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    wait_ready(proc, url, log)
    return proc, url


def run_guidellm(url: str, model: Path, args: argparse.Namespace, site: Path, out: Path) -> tuple[dict, float]:
    """GuideLLM's concurrent profile at each concurrency; its JSON report and the CPU cores its
    process tree used on average over the run (its CPU seconds over its wall seconds)."""
    concurrency = [int(c) for c in args.concurrency.split(",")]
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": str(model),
                        "request_format": "/v1/completions", "validate_backend": False},
            "tokenizer": {"kind": "huggingface_auto", "model": str(model)},
            "profile": {"kind": "concurrent", "streams": concurrency[0]},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                      "output_tokens": args.output_tokens}],
            "constraints": [{"kind": "max_duration", "seconds": args.seconds}],
            "outputs": [{"kind": "json", "path": str(out)}],
        },
        "benchmarks": [{"profile.streams": c} for c in concurrency],
    }
    path = out.with_suffix(".scenario.json")
    path.write_text(json.dumps(scenario, indent=1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    before, began = _children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "guidellm", "run", "--scenario", str(path), "--disable-console-interactive"],
                   check=True, env=env, timeout=args.seconds * len(concurrency) * 4 + 600)
    cores = (_children_cpu() - before) / (time.perf_counter() - began)
    return json.loads(out.read_text()), cores


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_plain(url: str, model: Path, args: argparse.Namespace, vocab: int) -> list[dict]:
    """The plain multi-process client at each concurrency, on the same worker and workload."""
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        row = http_client.drive(url, str(model), c, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                seconds=args.seconds, vocab=vocab, words=True, processes=args.client_processes)
        rows.append({k: row[k] for k in ("concurrency", "tokens_per_s", "requests_completed", "errors", "ttft_ms",
                                         "itl_ms", "client_cpu", "processes")})
    return rows


def _get(tree: dict, *keys: str, default=None):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def summarize_guidellm(report: dict) -> list[dict]:
    """Per benchmark: concurrency, output tokens/s, TTFT and inter-token latency percentiles (ms)."""
    rows = []
    for bench in report.get("benchmarks", []):
        metrics = bench.get("metrics", {})

        def pct(name: str, metrics: dict = metrics) -> dict:
            return {q: _get(metrics, name, "successful", "percentiles", q) for q in ("p50", "p90", "p99")} | {
                "mean": _get(metrics, name, "successful", "mean")}

        rows.append({
            "concurrency": _get(bench, "config", "strategy", "streams"),
            # What GuideLLM reports as output tokens/s (the mean of its per-request-window rates).
            "tokens_per_s": _get(metrics, "output_tokens_per_second", "successful", "mean"),
            "output_tokens": _get(metrics, "output_token_count", "successful", "total_sum"),
            "duration_s": bench.get("duration"),
            "requests_completed": _get(metrics, "request_totals", "successful"),
            "requests_errored": _get(metrics, "request_totals", "errored"),
            "ttft_ms": pct("time_to_first_token_ms"), "itl_ms": pct("inter_token_latency_ms"),
        })
    return rows


def run_grpc(model: Path, args: argparse.Namespace, out: Path) -> dict:
    scenarios = ",".join(f"c{c}-p{args.prompt_tokens}-o{args.output_tokens}" for c in args.concurrency.split(","))
    subprocess.run([sys.executable, str(ROOT / "bench" / "load_bench.py"), "--preset", args.preset,
                    "--model", str(model), "--device", args.device, "--dtype", args.dtype, "--scenarios", scenarios,
                    "--seconds", str(args.seconds), "--budget", str(GRPC_BENCH_BUDGET), "--no-step-times",
                    "--label", "gRPC, same workload as openai_bench",
                    "--worker-args", f"--max-seq-len {args.max_seq_len} {args.worker_args}".strip(), "--out",
                    str(out)], check=True, timeout=args.seconds * 3 * len(scenarios.split(",")) + 1800)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=30.0, help="per concurrency, per path")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--worker-args", default="", help="more worker flags, for both paths")
    parser.add_argument("--wheels", default=str(ROOT / ".benchwhl-b"),
                        help="the carried wheels (bench/openai_bench_wheels.sh) not yet installed in --site")
    parser.add_argument("--site", default="", help="where GuideLLM is (or gets) installed (default: a temp dir)")
    parser.add_argument("--models", default="", help="where the model directories are made (default: a temp dir)")
    parser.add_argument("--paths", default="http,grpc", help="http, grpc or both")
    parser.add_argument("--clients", default="guidellm,plain",
                        help="the HTTP clients: guidellm, plain (bench/http_client.py) or both, on one worker")
    parser.add_argument("--client-processes", type=int, default=0,
                        help="the plain client's processes (0: one per core, at most one per stream)")
    parser.add_argument("--out", default=os.environ.get("OUT", "openai-bench-out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    site = Path(args.site or tempfile.mkdtemp(prefix="guidellm-site-"))
    models = Path(args.models or tempfile.mkdtemp(prefix="openai-bench-models-"))
    paths = set(args.paths.split(","))
    clients = set(args.clients.split(","))
    # The worker imports aiohttp, which the GPU image lacks: it comes with the carried wheels, and
    # every process started from here (workers, GuideLLM, load_bench) sees them.
    if "guidellm" in clients:
        install_client(Path(args.wheels), site)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    began = time.perf_counter()
    model = prepare_model(args.preset, args.device, args.dtype, models)
    print(f"model directory {model} ready after {time.perf_counter() - began:.0f} s", flush=True)
    results: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "commit": os.environ.get("GRAPHKEEPER_COMMIT", ""), "preset": args.preset, "dtype": args.dtype,
        "device": args.device, "workload": {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                                            "ignore_eos": True, "concurrency": args.concurrency,
                                            "seconds": args.seconds},
        "clients": sorted(clients), "http": [], "http_plain": [], "grpc": [],
    }
    if "http" in paths:
        max_seqs = max(64, *(int(c) for c in args.concurrency.split(",")))
        proc, url = start_worker(model, args, max_seqs, out / f"worker-http-{args.preset}.log")
        try:
            if "guidellm" in clients:
                report, cores = run_guidellm(url, model, args, site, out / f"guidellm-{args.preset}.json")
                results["http"] = [row | {"client_cpu": {"cores_used": cores}} for row in summarize_guidellm(report)]
            if "plain" in clients:
                vocab = json.loads((model / "config.json").read_text())["vocab_size"]
                results["http_plain"] = run_plain(url, model, args, vocab)
        finally:
            proc.terminate()
            proc.wait(120)
    if "grpc" in paths:
        grpc = run_grpc(model, args, out / f"grpc-{args.preset}.json")
        results["grpc"] = [{"concurrency": row["streams"], "tokens_per_s": row["tokens_per_s"],
                            "requests_completed": row["requests_completed"], "errors": row["errors"],
                            "ttft_ms": row["ttft_ms"], "itl_ms": row["itl_ms"]} for row in grpc["scenarios"]]
    by_c = {row["concurrency"]: row for row in results["grpc"]}
    for row in results["http"] + results["http_plain"]:
        other = by_c.get(row["concurrency"])
        if other and other["tokens_per_s"] and row["tokens_per_s"] is not None:
            row["ratio_to_grpc"] = row["tokens_per_s"] / other["tokens_per_s"]
    (out / f"openai-{args.preset}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"openai-{args.preset}.md").write_text(markdown(results))
    print(markdown(results), flush=True)
    return 0


def markdown(results: dict) -> str:
    w = results["workload"]
    lines = [f"# {results['preset']} ({results['dtype']}, {results['device']}): OpenAI HTTP (GuideLLM, plain "
             f"client) vs gRPC (load_bench)", "",
             f"Random prompts of {w['prompt_tokens']} tokens, {w['output_tokens']} new tokens, ignore_eos, "
             f"{w['seconds']:g} s per concurrency and path. {results['date']} {results['commit']}. Client CPU: "
             "cores its processes used on average (the plain client: and its busiest process's share of a core; "
             f"above {http_client.BUSY:.0%} it may be the limit).", "",
             "| path | concurrency | output tok/s | HTTP/gRPC | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
             "| client CPU |", "|---|---|---|---|---|---|---|"]
    for path, name in (("http", "http (GuideLLM)"), ("http_plain", "http (plain client)"), ("grpc", "grpc")):
        for row in results.get(path, []):
            ratio = f"{row['ratio_to_grpc']:.3f}" if "ratio_to_grpc" in row else ""
            lines.append(f"| {name} | {row['concurrency']} | {_num(row['tokens_per_s'])} | {ratio} | "
                         f"{_pcts(row['ttft_ms'])} | {_pcts(row['itl_ms'])} | {_cpu(row.get('client_cpu'))} |")
    return "\n".join(lines) + "\n"


def _cpu(cpu: dict | None) -> str:
    if not cpu:
        return "-"
    busiest = cpu.get("busiest_process")
    return f"{cpu['cores_used']:.2f} cores" + (f", busiest {busiest:.0%}" if busiest is not None else "")


def _num(value) -> str:
    return f"{value:.0f}" if isinstance(value, int | float) else "-"


def _pcts(p: dict) -> str:
    return " / ".join(f"{p[q]:.1f}" if isinstance(p.get(q), int | float) else "-" for q in ("p50", "p90", "p99"))


if __name__ == "__main__":
    sys.exit(main())
