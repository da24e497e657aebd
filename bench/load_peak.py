"""Peak memory while loading a model, against the weights' own size.

The loader allocates every parameter once, in the target dtype, and fills it tensor by tensor,
so device memory after loading should equal the weights' bytes and the allocator's peak stay
within ~1.1x of them (the previous loader built float32 parameters and cast them: 1.5x for
bf16). Prints one JSON document, and writes it with ``--out``.

    python bench/load_peak.py                                   # random:llama-8b, bf16, cuda:0
    python bench/load_peak.py --save-as /tmp/llama8b            # also write it as a checkpoint and load that
    python bench/load_peak.py --source random:tiny --device cpu # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from graphkeeper.worker.model.loader import load_model, save_hf_directory


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(source: str, device: torch.device, dtype: str, max_positions: int) -> dict:
    """Loads ``source`` once and returns its ledger: weights' bytes, memory after, the peak."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
        free_before, total = torch.cuda.mem_get_info(device)
    started = time.perf_counter()
    loaded = load_model(source, device=device, dtype=dtype, max_positions=max_positions)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in loaded.model.buffers())
    out = {
        "source": source, "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(device),
        "parameters": loaded.parameter_count, "weights_bytes": weights, "buffers_bytes": buffers,
        "load_seconds": round(seconds, 3), "host_peak_rss_bytes": _rss_peak_bytes(),
    }
    if cuda:
        allocated = torch.cuda.memory_allocated(device) - allocated_before
        peak = torch.cuda.max_memory_allocated(device) - allocated_before
        free_after, _ = torch.cuda.mem_get_info(device)
        out |= {
            "device_allocated_after_bytes": allocated,
            "device_peak_allocated_bytes": peak,
            "device_used_growth_bytes": free_before - free_after,
            "device_total_bytes": total,
            "after_over_weights": round(allocated / weights, 4),
            "peak_over_weights": round(peak / weights, 4),
        }
    del loaded
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="random:llama-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--save-as", default="", help="also write the model here (HF layout) and load that")
    parser.add_argument("--keep", action="store_true", help="keep the --save-as directory")
    parser.add_argument("--out", default="", help="write the JSON here as well")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("load_peak: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    runs = [measure(args.source, device, args.dtype, args.max_positions)]
    if args.save_as:
        target = Path(args.save_as)
        # Written from a CPU copy in the same dtype: the checkpoint is what a real one would be.
        cpu = load_model(args.source, device="cpu", dtype=args.dtype, max_positions=16)
        save_hf_directory(cpu.model, target)
        del cpu
        runs.append(measure(str(target), device, args.dtype, args.max_positions))
        runs[-1]["checkpoint_bytes"] = sum(f.stat().st_size for f in target.glob("*.safetensors"))
        if not args.keep:
            shutil.rmtree(target)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]), "commit": commit, "host": platform.node(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "runs": runs,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
