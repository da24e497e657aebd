"""Keys for the on-disk caches of the step (compiled code) and of kernel tuning.

Both hash the same kinds of facts: library versions, the source of the modules whose code they
keep, and a few settings. A module's source is read from its own ``__file__``, so a cache keeps
hitting wherever the module lives in the tree, and a change to any listed module's code is a
new key.

Each cache also records the facts its key was made from (``key.json`` in a compile cache
directory, ``facts`` in a tuning file); a cache whose recorded facts differ from the worker's
(copied in from another node, or written by an older worker under the same name) is ignored with
a warning that names the facts that differ, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def source_digest(modules: Iterable[ModuleType]) -> str:
    """A hash of the given modules' source files, in the order given."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


#: Where the NVIDIA kernel module states its version (mounted into GPU containers by the NVIDIA
#: container toolkit).
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
_DRIVER_RE = re.compile(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)")


def library_versions() -> dict[str, str]:
    """The torch, triton, CUDA and GPU driver versions: a new one may generate or time other code."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - CPU-only installs
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "cuda": str(torch.version.cuda),
            "driver": driver_version()}


def driver_version(path: Path = DRIVER_VERSION_FILE) -> str:
    """The NVIDIA kernel driver's version (``550.54.15``), "unknown" where it cannot be read.

    Read from the kernel module's own statement rather than NVML or ``nvidia-smi``: no extra
    dependency and no subprocess on the startup path.
    """
    try:
        match = _DRIVER_RE.search(path.read_text(errors="replace"))
    except OSError:
        return "unknown"
    return match.group(1) if match else "unknown"


def differences(wanted: dict[str, Any], found: Any) -> list[str]:
    """The top-level facts of ``wanted`` that ``found`` (read from a cache) does not match (pure)."""
    if not isinstance(found, dict):
        return ["(no facts recorded)"]
    wanted = json.loads(json.dumps(wanted))  # as a cache holds them: tuples read back as lists
    return sorted(k for k in wanted.keys() | found.keys() if wanted.get(k) != found.get(k))


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """``data`` as ``path``: written under a name of this process's own, then renamed into place,
    so workers sharing a cache on one node never read a file half written. Raises OSError."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.replace(path)


def key_of(material: dict[str, Any]) -> str:
    """A short hex digest of JSON-ready ``material`` (pure; key order does not matter)."""
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]
