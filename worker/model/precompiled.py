"""The step's compiled pieces saved whole (torch's AOT precompile) beside the compile cache, and
loaded by the next start of the same step without Dynamo tracing them again.

Why: on a compile-cache hit a start still traces every piece with Dynamo before Inductor's cache
answers (bytecode tracing, fake tensors, guards): 1.4-1.6 s of a warm H100 start of ``llama-1b``
(9 s in all, against a target of 8), the largest part left (``bench/results``, 2026-12-07). A piece
compiled ahead (``aot_compile``) with the first call's arguments, the batch dimensions marked
dynamic as the jit path marks them, serializes with its guards, its bytecode and Inductor's code;
loading it runs none of the tracing: the warm compile stage read 0.4-0.7 s instead, READY warm
7.1-7.5 s (``bench/results/gpu-5ce1976-d73442e-h100.md``). vLLM does the same with
``VLLM_USE_AOT_COMPILE``.

Where: ``<compile cache dir>/precompiled/<piece>-<signature>.bin``. The directory's key covers
everything the generated code depends on (model shapes, dtype, quantization, kernels, GPU, library
versions, the step's source); the signature covers what the piece's guards check of its first
call's arguments (each tensor's dtype, device, shape with the batch dimension left out, strides,
and the grad mode), so a benchmark's runner that shares the cache with other buffers (a KV cache of
another length, grad mode on) keeps files of its own beside the worker's instead of replacing them
at every turn. A file that does not load (another torch, a truncated write) is replaced: the piece
compiles ahead again and is saved. Files appear whole (written under another name and renamed),
so workers starting together never read one half made.

Not with tensor parallelism: every rank's pieces have their own shard's shapes and one directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SUBDIR = "precompiled"


def available() -> bool:
    """Whether this torch can precompile (``aot_compile`` and ``load_compiled_function``, torch 2.10+)."""
    import torch._dynamo

    return hasattr(torch._dynamo.config, "enable_aot_compile") and hasattr(torch.compiler, "load_compiled_function")


class Outcomes:
    """What the pieces of one step did at their first call: loaded from a file, or compiled ahead
    and saved (the compile report's cache outcome when every piece loaded)."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.compiled: list[str] = []

    def every_piece_loaded(self, pieces: int) -> bool:
        return len(self.loaded) == pieces and not self.compiled


class PrecompiledPiece:
    """One piece, precompiled: its first call loads the file in ``directory`` named for that call's
    arguments (``signature``), or compiles the piece ahead from them (their first ``dynamic_args``
    tensors' batch dimension dynamic) and saves it there, and runs it with its guards checked;
    every call after runs it without them.

    Why without: a precompiled function checks its guards in Python at every call (binding the
    arguments, about 100 us a call of a 2-core CPU, against half that with them off), and the
    engine calls each piece once per layer of every eager step. Its calls differ only in the batch
    dimension, which is dynamic: the same buffers' dtypes, devices and other sizes every time (the
    GPU test of one compilation per piece at every size holds the jit path to it). vLLM skips
    Dynamo's guards for its compiled step the same way."""

    def __init__(self, compile: Callable[[], Any], dynamic_args: int, directory: Path, name: str,
                 outcomes: Outcomes) -> None:
        #: Makes ``torch.compile(piece, ...)`` as the jit path does (``step.jit_compiled``), called
        #: with AOT compile on (the compiled function has ``aot_compile`` only when made so).
        self.compile, self.dynamic_args, self.outcomes = compile, dynamic_args, outcomes
        self.directory, self.name = directory, name
        self._target: Callable | None = None

    def __call__(self, *args: Any) -> Any:
        if self._target is not None:
            return self._target(*args)
        path = self.directory / f"{self.name}-{signature(args, self.dynamic_args)}.bin"
        target = self._load(path, args) or self._compile(path, args)
        out = target(*args)  # guards checked
        target.disable_guard_check()
        self._target = target
        return out

    def _load(self, path: Path, args: tuple) -> Callable | None:
        """The function saved at ``path``, if it loads and its guards take ``args``."""
        if not path.exists():
            return None
        try:
            with path.open("rb") as f:
                loaded = torch.compiler.load_compiled_function(f)
            fits = loaded.guard_check(*args)
        except Exception as err:  # noqa: BLE001 - a file that does not load is compiled again, never a failed start
            log.warning("precompiled %s at %s did not load (%s): compiling it again", self.name, path, err)
            return None
        if not fits:
            log.warning("precompiled %s at %s does not take this step's arguments: compiling it again",
                        self.name, path)
            return None
        self.outcomes.loaded.append(self.name)
        return loaded

    def _compile(self, path: Path, args: tuple) -> Callable:
        """The piece compiled ahead from ``args``, saved at ``path`` (an unsaved one is logged)."""
        import torch._dynamo

        mark_batch_dynamic(args, self.dynamic_args)
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = self.compile().aot_compile((args, {}))
        self.outcomes.compiled.append(self.name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f"{path.name}.{os.getpid()}.new")
            compiled.save_compiled_function(str(staging))
            staging.replace(path)
        except Exception as err:  # noqa: BLE001 - an unsaved piece costs the next start its load, not this start
            log.warning("precompiled %s not saved to %s: %s", self.name, path, err)
        return compiled


def mark_batch_dynamic(args: tuple, dynamic_args: int) -> None:
    """Marks the first dimension (the batch: rows or tokens) of the first ``dynamic_args`` tensors
    dynamic, before the call that traces them: every later size runs the same compiled code."""
    import torch._dynamo

    for tensor in args[:dynamic_args]:
        torch._dynamo.mark_dynamic(tensor, 0)


def signature(args: tuple, dynamic_args: int) -> str:
    """A short digest of what a piece's guards check of ``args`` (pure but for the grad mode): each
    tensor's dtype, device type, shape (the batch dimension of the first ``dynamic_args`` left
    out: it is dynamic) and strides, every other argument's type and value, and the grad and
    inference modes."""
    facts: list[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            shape = list(arg.shape)
            if i < dynamic_args and shape:
                shape[0] = -1
            facts.append((str(arg.dtype), arg.device.type, shape, list(arg.stride()), arg.requires_grad))
        else:
            facts.append((type(arg).__name__, repr(arg)))
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:12]


def pieces_dir(cache_dir: str) -> Path:
    """Where a compile cache directory keeps its precompiled pieces."""
    return Path(cache_dir) / SUBDIR
