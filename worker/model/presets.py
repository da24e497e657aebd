"""The ``-O`` presets: what a worker compiles and captures, decided in one pure function.

Presets trade startup for speed: 0 runs eagerly with no graphs, 1 captures graphs of the
uncompiled step (fused Triton kernels where they pay), 2 compiles the pieces and then captures.
An explicit ``--compile``/``--no-compile`` or a policy's graph mode overrides the preset.
A module of its own, importing no kernel, so the worker's API process checks its flags without
loading the device side.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphkeeper.proto import worker_pb2 as pb

LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class Optimization:
    """What a worker runs with, after the preset, explicit flags and the device are combined."""

    level: int
    compile: bool
    default_graph_mode: int  # the worker's graph mode when no policy names one
    reason: str  # why compile is what it is, for status and logs


def resolve(level: int, compile_flag: bool | None, device_type: str) -> Optimization:
    """The preset ``level`` with explicit settings applied over it (pure).

    -O0: no compile, no graphs. -O1: graphs, no compile. -O2: compile, then graphs.
    ``compile_flag`` (``--compile``/``--no-compile``) overrides the preset's compile; compilation
    needs CUDA (Inductor's CPU code would need a C++ toolchain on every node and is not what runs).
    """
    if level not in LEVELS:
        raise ValueError(f"optimization level {level} is not one of {', '.join(map(str, LEVELS))}")
    wanted = level >= 2 if compile_flag is None else compile_flag
    source = f"preset -O{level}" if compile_flag is None else ("--compile" if compile_flag else "--no-compile")
    mode = pb.GRAPH_MODE_NONE if level == 0 else pb.GRAPH_MODE_FULL_AND_PIECEWISE
    if wanted and device_type != "cuda":
        return Optimization(level, False, mode, f"{source} asks for compilation, but it runs only on CUDA")
    return Optimization(level, wanted, mode, source)
