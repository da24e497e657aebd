"""Does a CUDA graph survive its memory being released and mapped again at the same address?

The mechanism sleep and wake would rest on (issue Startup II): device memory reserved as a virtual
address range with the CUDA driver's virtual memory API (``cuMemAddressReserve``), backed by
physical memory (``cuMemCreate`` + ``cuMemMap``) that can be released (``cuMemUnmap`` +
``cuMemRelease``) while the addresses stay reserved, then backed again at the same addresses. A
graph captured over tensors in that range keeps pointing at valid memory, so it should replay
with the same result after the round trip, with no recapture.

The probe, on the GPU machine (ctypes over ``libcuda.so.1``; nothing compiled):

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
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

GIB = 1 << 30
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The handful of driver calls the probe needs, each checked."""

    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                    location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device))
        self.access = _AccessDesc(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device),
                                  flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(self.prop),
                  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return size.value

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                  ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        return ptr.value

    def back(self, ptr: int, size: int) -> int:
        """Create physical memory and map it at ``ptr``; returns the physical handle."""
        handle = ctypes.c_ulonglong()
        self.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                  ctypes.c_ulonglong(0))
        self.call("cuMemMap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                  ctypes.c_ulonglong(0))
        self.call("cuMemSetAccess", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size),
                  ctypes.byref(self.access), ctypes.c_size_t(1))
        return handle.value

    def unback(self, ptr: int, size: int, handle: int) -> None:
        self.call("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        self.call("cuMemRelease", ctypes.c_ulonglong(handle))


class _Range:
    """A device range as ``__cuda_array_interface__``, so torch views it without a copy."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def probe(gib: float) -> dict:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    driver = Driver(torch.cuda.current_device())
    grain = driver.granularity()
    size = -(-int(gib * GIB) // grain) * grain
    free_before, total = torch.cuda.mem_get_info()
    ptr = driver.reserve(size)
    handle = driver.back(ptr, size)
    free_mapped, _ = torch.cuda.mem_get_info()
    raw = torch.as_tensor(_Range(ptr, size), device="cuda")
    floats = raw.view(torch.float32)
    floats.normal_()
    linear = torch.nn.Linear(4096, 4096, bias=False, device="cuda")
    weight = floats[: 4096 * 4096].view(4096, 4096)
    linear.weight.data = weight
    x = torch.randn(8, 4096, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            y, s = linear(x), floats.sum()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, s = linear(x), floats.sum()
    graph.replay()
    torch.cuda.synchronize()
    y_before, s_before = y.clone(), s.clone()

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    t0 = time.perf_counter()
    host.copy_(raw)
    torch.cuda.synchronize()
    driver.unback(ptr, size, handle)
    sleep_s = time.perf_counter() - t0
    free_asleep, _ = torch.cuda.mem_get_info()

    t0 = time.perf_counter()
    handle = driver.back(ptr, size)
    raw.copy_(host)
    graph.replay()
    torch.cuda.synchronize()
    wake_s = time.perf_counter() - t0
    same = bool(torch.equal(y, y_before) and torch.equal(s, s_before))
    return {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "granularity_bytes": grain,
        "range_bytes": size, "mapped_took_bytes": free_before - free_mapped,
        "sleep_released_bytes": free_asleep - free_mapped, "released_share": (free_asleep - free_mapped) / size,
        "sleep_s": sleep_s, "wake_and_replay_s": wake_s, "replay_after_wake_equal": same,
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
