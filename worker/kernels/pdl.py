"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

Inside a captured step one kernel follows another with about a microsecond of launch between
them, and each then ramps up to full memory bandwidth. With PDL (Hopper and later) the next
kernel is launched early: it loads what does not depend on its predecessor (a projection's
weights), waits at ``griddepcontrol.wait`` until the predecessor's writes are visible, and lets
its own successor launch. Captured into a CUDA graph, the dependency becomes a programmatic edge.

The worker's Triton kernels take ``USE_PDL``, call ``await_inputs`` and launch with
``launch_options()``. It is off until
``probe`` has recorded and replayed a PDL launch in a CUDA graph on this device and checked its
result, so an older driver or GPU runs the same kernels with plain launches.
"""

from __future__ import annotations

import logging

import torch

from graphkeeper.worker.kernels.triton_support import tl, triton

log = logging.getLogger(__name__)

_enabled = False
_probed: dict[int, bool] = {}


def enabled() -> bool:
    return _enabled


def launch_options() -> dict[str, bool]:
    """Keyword arguments for a Triton launch of a kernel that takes ``USE_PDL``."""
    return {"USE_PDL": True, "launch_pdl": True} if _enabled else {"USE_PDL": False}


def set_enabled(value: bool) -> None:
    """Turns PDL on or off for later launches (tests compare both; ``probe`` decides for workers)."""
    global _enabled
    _enabled = value


if triton is not None:

    @triton.jit
    def await_inputs(USE_PDL: tl.constexpr):
        """Under PDL: waits until the previous kernel's writes are visible, then lets the next
        kernel launch. A kernel calls it before it reads anything an earlier kernel wrote."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _probe_kernel(x_ptr, out_ptr, USE_PDL: tl.constexpr):
        i = tl.arange(0, 128)
        await_inputs(USE_PDL)
        tl.store(out_ptr + i, tl.load(x_ptr + i) + 1.0)


def probe(device: torch.device) -> bool:
    """Enables PDL when this device records and replays it correctly in a CUDA graph."""
    global _enabled
    if device.type != "cuda" or triton is None:
        _enabled = False
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _probed:
        _probed[index] = _try(device)
    _enabled = _probed[index]
    return _enabled


def _try(device: torch.device) -> bool:
    if torch.cuda.get_device_capability(device)[0] < 9:
        log.info("programmatic dependent launch off: needs compute capability 9.0 or later")
        return False
    try:
        x = torch.zeros(128, device=device)
        a, b = torch.empty_like(x), torch.empty_like(x)
        opts = {"USE_PDL": True, "launch_pdl": True}
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            _probe_kernel[(1,)](x, a, **opts)
            _probe_kernel[(1,)](a, b, **opts)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                _probe_kernel[(1,)](x, a, **opts)
                _probe_kernel[(1,)](a, b, **opts)
        torch.cuda.current_stream(device).wait_stream(stream)
        x.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize(device)
        ok = bool(torch.all(b == 3.0))
        graph.reset()
    except Exception as err:  # noqa: BLE001 - any failure means: plain launches
        log.info("programmatic dependent launch off: %s", err)
        return False
    if not ok:
        log.warning("programmatic dependent launch off: a recorded PDL chain gave a wrong result")
    return ok
