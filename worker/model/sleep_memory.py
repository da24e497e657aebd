"""Device memory whose physical pages can be given back while its addresses stay put.

A captured CUDA graph holds raw device addresses: the weights it reads and the KV cache it writes.
To let a sleeping worker give its memory back and still replay the same graphs after waking, the
weights and the KV cache live in ranges reserved with the CUDA driver's virtual memory API
(``cuMemAddressReserve``) and backed by physical memory (``cuMemCreate`` + ``cuMemMap``). Sleep
unmaps and releases the physical memory (after copying what must survive to pinned host memory);
wake creates and maps new physical memory at the same addresses and copies it back. The addresses
never change, so every graph stays valid and nothing is recaptured.

The driver is reached through ``ctypes`` over ``libcuda.so.1`` (already loaded by torch), so
nothing is compiled. Torch sees a range as an ordinary tensor through ``__cuda_array_interface__``.
Only a worker started with ``--enable-sleep-mode`` on a CUDA device puts its memory here.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
#: Every tensor carved from a region starts on this boundary (what torch's allocator guarantees).
ALIGNMENT = 512


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


class DriverError(RuntimeError):
    pass


class Driver:
    """The driver calls a region needs, each checked (a failure raises, naming the call)."""

    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                    location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device))
        self.access = _AccessDesc(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device),
                                  flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise DriverError(f"{name} failed with CUresult {rc}")

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
        """Creates physical memory and maps it at ``ptr``, readable and writable; its handle."""
        handle = ctypes.c_ulonglong()
        self.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                  ctypes.c_ulonglong(0))
        try:
            self.call("cuMemMap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                      ctypes.c_ulonglong(0))
        except DriverError:
            self.call("cuMemRelease", handle)
            raise
        self.call("cuMemSetAccess", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size),
                  ctypes.byref(self.access), ctypes.c_size_t(1))
        return handle.value

    def unback(self, ptr: int, size: int, handle: int) -> None:
        self.call("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        self.call("cuMemRelease", ctypes.c_ulonglong(handle))

    def unreserve(self, ptr: int, size: int) -> None:
        self.call("cuMemAddressFree", ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))


class _Range:
    """A device range as ``__cuda_array_interface__``: torch views it without a copy, and the
    tensors viewing it keep this object (and so its region) alive."""

    def __init__(self, region: SleepableRegion) -> None:
        self.region = region
        self.__cuda_array_interface__ = {"shape": (region.size,), "typestr": "|u1",
                                         "data": (region.ptr, False), "version": 3, "strides": None}


def _free(driver: Driver, ptr: int, size: int, handle: list[int]) -> None:
    """The finalizer: physical memory (if mapped) and the address range go back."""
    try:
        if handle:
            driver.unback(ptr, size, handle.pop())
        driver.unreserve(ptr, size)
    except DriverError as exc:  # at exit the context may already be gone
        log.debug("freeing a sleepable region: %s", exc)


class SleepableRegion:
    """``size`` bytes at a fixed device address, carved into tensors, whose backing can go and come
    back. Freed (unmapped, address released) once the region and every tensor over it are gone."""

    def __init__(self, nbytes: int, name: str, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.driver = Driver(index)
        grain = self.driver.granularity()
        self.name = name
        self.size = max(grain, -(-nbytes // grain) * grain)
        self.ptr = self.driver.reserve(self.size)
        self._handle: list[int] = []  # the physical memory's handle while mapped (a list: shared with the finalizer)
        self._kept: Tensor | None = None  # pinned host copy while asleep, if kept
        self._handle.append(self.driver.back(self.ptr, self.size))
        self._finalizer = weakref.finalize(self, _free, self.driver, self.ptr, self.size, self._handle)
        self.bytes = torch.as_tensor(_Range(self), device=device)
        self._used = 0

    @property
    def mapped(self) -> bool:
        return bool(self._handle)

    @property
    def kept(self) -> bool:
        """Released with its contents waiting in pinned host memory."""
        return self._kept is not None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """The next free bytes as a tensor of ``shape`` and ``dtype`` (contents undefined)."""
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if start + n > self.size:
            raise ValueError(f"region {self.name} ({self.size} bytes) has no room for {n} more at {start}")
        self._used = start + n
        return self.bytes[start:start + n].view(dtype).view(shape)

    def release(self, keep: bool) -> int:
        """Gives the physical memory back; with ``keep`` its contents wait in pinned host memory.
        Returns the bytes released. The caller has synchronised: nothing may touch it meanwhile."""
        if not self.mapped:
            return 0
        if keep:
            self._kept = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
            self._kept.copy_(self.bytes)
            torch.cuda.synchronize()
        self.driver.unback(self.ptr, self.size, self._handle.pop())
        return self.size

    def restore(self) -> bool:
        """Backs the same addresses again; True when the contents came back (kept at release),
        False when they are undefined and the owner must write them."""
        if self.mapped:
            return True
        self._handle.append(self.driver.back(self.ptr, self.size))
        if self._kept is None:
            return False
        self.bytes.copy_(self._kept, non_blocking=True)
        torch.cuda.synchronize()
        self._kept = None
        return True


def parameters_of(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Tensor]]:
    """(owner, name, parameter) for every parameter on the device, each owner's once."""
    return [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items()
            if p is not None and p.device.type == "cuda"]


@torch.no_grad()
def move_into_region(module: torch.nn.Module, device: torch.device, name: str = "weights") -> SleepableRegion:
    """Moves every device parameter of ``module`` into one sleepable region (a parameter shared by
    two owners, such as tied embeddings, stays shared); the old memory is freed once nothing else
    holds it. Buffers (rotary tables, fp8 scales: small, and not weights a reload rewrites) stay
    in torch's memory and are never released."""
    entries = parameters_of(module)
    unique = {id(p): p for *_, p in entries}
    total = sum(-(-p.nbytes // ALIGNMENT) * ALIGNMENT for p in unique.values())
    region = SleepableRegion(total, name, device)
    moved: dict[int, torch.nn.Parameter] = {}
    for owner, key, param in entries:
        if id(param) not in moved:
            dest = region.take(tuple(param.shape), param.dtype)
            dest.copy_(param)
            moved[id(param)] = torch.nn.Parameter(dest, requires_grad=False)
        owner._parameters[key] = moved[id(param)]
    torch.cuda.synchronize()
    return region
