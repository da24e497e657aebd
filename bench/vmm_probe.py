"""Does a CUDA graph survive its memory being released and mapped again at the same address?

The mechanism sleep and wake rest on: device memory reserved as a virtual
address range with the CUDA driver's virtual memory API (``cuMemAddressReserve``), backed by
physical memory (``cuMemCreate`` + ``cuMemMap``) that can be released (``cuMemUnmap`` +
``cuMemRelease``) while the addresses stay reserved, then backed again at the same addresses. A
graph captured over tensors in that range keeps pointing at valid memory, so it should replay
with the same result after the round trip, with no recapture.

The probe, on the GPU machine, through ``worker/model/sleep_memory.py`` (ctypes over
``libcuda.so.1``; nothing compiled):

1. reserve and map ``--gib`` GiB, view it as a float32 tensor (``__cuda_array_interface__``), put
   an ``nn.Linear``'s weight in it, and capture a graph of the linear layer and of a reduction over
   the whole range;
2. sleep: copy the range to pinned host memory, unmap and release the physical memory, and read
   how much device memory came back (``cudaMemGetInfo``);
3. wake: create and map physical memory at the same addresses, copy the contents back, replay the
   graphs and compare with the outputs before sleep, exactly.

    python3 bench/vmm_probe.py --out $out/vmm-probe-h200.json     # H200: prints and writes the JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from graphkeeper.worker.model.sleep_memory import SleepableRegion

GIB = 1 << 30


class RegionGraph:
    """A graph over a sleepable region: an ``nn.Linear`` whose weight lives in the region and a
    reduction over the whole range (and, with ``plain_bytes``, over ordinary torch memory too),
    captured and replayed once; ``same()`` replays it and compares with that first replay, exactly.
    ``bench/checkpoint_probe.py`` captures the same graph."""

    def __init__(self, region: SleepableRegion, plain_bytes: int = 0) -> None:
        floats = region.take((region.size // 4,), torch.float32)
        floats.normal_()
        linear = torch.nn.Linear(4096, 4096, bias=False, device="cuda")
        linear.weight = torch.nn.Parameter(floats[: 4096 * 4096].view(4096, 4096), requires_grad=False)
        x = torch.randn(8, 4096, device="cuda")
        plain = torch.randn(plain_bytes // 4, device="cuda")

        def run() -> tuple[torch.Tensor, ...]:
            return linear(x), floats.sum(), *(((plain * 2).sum(),) if plain_bytes else ())

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.outputs = run()
        self.graph.replay()
        torch.cuda.synchronize()
        self.before = tuple(t.clone() for t in self.outputs)
        self._keep = (linear, x, plain)  # what the graph reads stays alive with it

    def same(self) -> bool:
        """Replays the graph; whether every output equals the first replay's."""
        self.graph.replay()
        torch.cuda.synchronize()
        return all(bool(torch.equal(a, b)) for a, b in zip(self.outputs, self.before, strict=True))


def probe(gib: float) -> dict:
    torch.zeros(1, device="cuda")
    free_before, total = torch.cuda.mem_get_info()
    region = SleepableRegion(int(gib * GIB), "probe", torch.device("cuda"))
    free_mapped, _ = torch.cuda.mem_get_info()
    graph = RegionGraph(region)

    t0 = time.perf_counter()
    released = region.release(keep=True)
    sleep_s = time.perf_counter() - t0
    free_asleep, _ = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    kept = region.restore()
    same = graph.same()
    wake_s = time.perf_counter() - t0
    return {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "range_bytes": region.size,
        "mapped_took_bytes": free_before - free_mapped, "released_bytes": released,
        "driver_freed_bytes": free_asleep - free_mapped, "released_share": (free_asleep - free_mapped) / region.size,
        "sleep_s": sleep_s, "wake_and_replay_s": wake_s, "contents_kept": kept, "replay_after_wake_equal": same,
        "device_total_bytes": total,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = probe(args.gib)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["replay_after_wake_equal"] and result["released_share"] > 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
