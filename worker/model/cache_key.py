"""Keys for the on-disk caches of the step (compiled code) and of kernel tuning.

Both hash the same kinds of facts: library versions, the source of the modules whose code they
keep, and a few settings. A module's source is read from its own ``__file__``, so a cache keeps
hitting wherever the module lives in the tree, and a change to any listed module's code is a
new key.
"""

from __future__ import annotations

import hashlib
import json
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


def library_versions() -> dict[str, str]:
    """The torch, triton and CUDA versions: a new one may generate or time other code."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - CPU-only installs
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "cuda": str(torch.version.cuda)}


def key_of(material: dict[str, Any]) -> str:
    """A short hex digest of JSON-ready ``material`` (pure; key order does not matter)."""
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]
