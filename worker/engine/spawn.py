"""The engine core's process, spawned first: it imports torch and the engine while the worker
(API) process checks its flags and imports its servers, then waits for its settings.

Both processes import for a second or more before either does anything else, and nothing the
engine core imports depends on the flags, so they need not take turns: the worker spawns the
engine core as soon as its command line is parsed (``graphkeeper.cli``), and ``EngineClient``
hands it the settings once the boot checks pass. When they do not, the worker exits with its
one-line refusal and the engine core, still importing or waiting, is killed first and says
nothing (``PR_SET_PDEATHSIG`` kills it too if the worker itself is killed).

This module imports only the standard library (``compiles`` reads the presets when called), but
it lives in the engine's room, so the worker imports the engine package's face (numpy, protobuf,
prometheus: about 0.2 s here) before it can spawn; it imports that face anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

#: The interpreter's switch interval in both processes: a thread gets the interpreter back
#: quickly from another (the API layer's from the engine thread's, the receiver's from the step's).
#: Read when used (bench/thread_sampler.py sets another).
SWITCH_INTERVAL_SECONDS = 0.0005
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent dies (Linux); exits at once if it is already gone."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the channel's EOF still ends this process
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def engine_core_main(conn: Connection, parent_pid: int, log_level: str, switch_interval: float,
                     import_compiler: bool = False) -> None:
    """The engine-core process's entry point (``multiprocessing`` spawn target): imports the device
    side, then runs the engine with the settings the worker sends once its checks pass.
    ``import_compiler``: the worker's flags compile the step, so torch's compiler is imported on a
    thread while the settings are awaited (``model/compiler_import.py``)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker owns shutdown, from the first moment
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from graphkeeper.worker.engine import process  # torch and the engine, while the worker checks its flags

    if import_compiler:
        from graphkeeper.worker.model import compiler_import

        compiler_import.start()

    try:
        settings = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the worker refused its flags (or failed to start): nothing to report
        os._exit(0)
    process.main(conn, settings, parent_pid, log_level, switch_interval)


@dataclass
class SpawnedCore:
    """An engine core started before its settings exist: the process, the worker's end of the
    channel, and when it was spawned (the end of the ``before_engine`` stage)."""

    proc: BaseProcess
    conn: Connection
    spawned_at: float
    #: Whether the settings went out: from then on ``EngineClient`` owns the process.
    handed: bool = field(default=False)

    def send_settings(self, settings: Any) -> None:
        """The engine core's settings, its first message (it decides its sizes from them)."""
        self.conn.send_bytes(pickle.dumps(settings, protocol=pickle.HIGHEST_PROTOCOL))
        self.handed = True

    def abandon(self) -> None:
        """The worker will not start (a refused flag, a failure before the engine): an engine core
        that got no settings has only imported, so it is killed at once and the worker's refusal
        waits for nothing. One that got them is ``EngineClient``'s to stop (this does nothing)."""
        if self.handed:
            return
        self.conn.close()
        self.proc.kill()
        self.proc.join()


def compiles(level: int, compile_flag: bool | None, device: str) -> bool:
    """Whether a worker with these flags compiles its step (``presets.resolve``'s decision on
    ``--device`` as ``cuda_probe.parse_device`` reads it), known before anything checks the flags:
    the engine core, spawned first, is told so and imports torch's compiler from the end of its
    own imports (``import_compiler``). A flag the checks refuse costs nothing: that engine core is
    killed unused."""
    from graphkeeper.worker.engine.cuda_probe import parse_device
    from graphkeeper.worker.model.presets import LEVELS, resolve

    parsed = parse_device(device)
    return parsed is not None and level in LEVELS and resolve(level, compile_flag, parsed[0]).compile


def spawn_core(log_level: str, import_compiler: bool = False) -> SpawnedCore:
    """Spawns the engine core now (a fresh interpreter: CUDA is never initialised in a forked
    child); call from the main thread, since the child dies with the thread that started it.
    ``import_compiler``: whether the worker's flags compile the step (``engine_core_main``)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    spawned_at = time.time()
    proc = ctx.Process(target=engine_core_main, name="engine-core",
                       args=(theirs, os.getpid(), log_level, SWITCH_INTERVAL_SECONDS, import_compiler))
    proc.start()
    theirs.close()
    return SpawnedCore(proc, ours, spawned_at)
