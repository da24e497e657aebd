"""The worker's boot checks on ``--device``, without importing torch.

The API process checks ``--device`` before it spawns the engine core, and nothing else it does
needs torch: importing torch there (about 1 s, more with a CUDA build's libraries) would only
delay the spawn of the process that does need it. So the device string is parsed here, and the
GPUs are counted as ``torch.cuda.device_count()`` counts them (the CUDA driver's
``cuInit``/``cuDeviceGetCount``, which honour ``CUDA_VISIBLE_DEVICES``), provided the installed
torch was built for CUDA at all (its ``torch/version.py``, read as text) and the driver is at
least that CUDA's major version. A device string this parser does not know (``mps``,
``cuda:x``) is left to ``torch.device`` by the caller, so every refusal reads as before.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import re
from pathlib import Path

#: ``cpu``, ``cuda`` or ``cuda:N``: the only devices the worker serves on.
_DEVICE = re.compile(r"(cpu|cuda)(?::(0|[1-9][0-9]*))?")
#: CUDA_SUCCESS.
_OK = 0


def parse_device(device: str) -> tuple[str, int | None] | None:
    """``(type, index)`` for ``cpu``, ``cpu:N``, ``cuda`` and ``cuda:N``; None for anything else,
    which the caller hands to ``torch.device`` (pure)."""
    match = _DEVICE.fullmatch(device)
    if match is None:
        return None
    return match[1], None if match[2] is None else int(match[2])


def torch_cuda_version(version_py: str) -> str | None:
    """The CUDA version a ``torch/version.py`` text names (``cuda = '12.8'``), None for a build
    without CUDA (pure)."""
    for node in ast.parse(version_py).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value if isinstance(node.value.value, str) else None
    return None


def cuda_device_count() -> int:
    """The CUDA devices torch would see in this process (0 without a CUDA build of torch, a
    driver or a visible GPU)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return 0
    try:
        built_for = torch_cuda_version((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return 0
    if built_for is None:
        return 0
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    version, count = ctypes.c_int(0), ctypes.c_int(0)
    if driver.cuInit(0) != _OK or driver.cuDriverGetVersion(ctypes.byref(version)) != _OK:
        return 0
    if version.value // 1000 < int(built_for.split(".")[0]):
        return 0  # the runtime torch ships refuses an older driver's major version
    if driver.cuDeviceGetCount(ctypes.byref(count)) != _OK:
        return 0
    return count.value
