"""The rest of a sleeping worker's device memory given back: the CUDA driver's process checkpoint.

Sleep (``engine/sleep.py``) releases the weights' and the KV cache's sleepable regions, but the
engine-core process still holds its CUDA context, its graphs' executables and memory pool, and the
tensors torch's allocator keeps (the step's buffers): 2.1 GiB for ``llama-1b`` and 2.9 GiB for
``llama-8b`` on an H200, 32% and 11% of what those workers held
(``bench/results/sleep-3b6bea5-h200.json``). The driver's checkpoint API (display driver 570 or
later, the CUDA 12.8 driver API; Linux, x86-64) moves all of it to host memory and gives the device
memory back:

- ``cuCheckpointProcessLock`` lets the process's CUDA calls in flight finish and holds new ones;
- ``cuCheckpointProcessCheckpoint`` copies the process's device state to host memory (the
  driver's) and releases the device memory;
- ``cuCheckpointProcessRestore`` puts it back at the same addresses, so every captured graph
  replays as it was; ``cuCheckpointProcessUnlock`` lets the held calls through.

The API is for one process to call on another, so the engine runs this file as a short-lived
helper (``python -I context_offload.py offload|restore PID GPU_UUID``) and waits for it, making no
CUDA call meanwhile. The helper imports the standard library only (no torch: it starts in tens of
milliseconds), calls ``cuInit`` (no context, no device memory), and prints one JSON line: whether
it worked, why not, and how much device memory moved, read device-wide from NVML before and after
(the same view as the driver's free memory that ``sleep.py`` reads; None where NVML is missing).

What a failure leaves: an offload that fails after the lock unlocks the process, which keeps its
device memory and sleeps as before (regions released, context kept), with the reason logged and
reported. The driver does not promise a usable process after an error mid-checkpoint (nor does it
take UVM or IPC memory, which the worker does not use): a process it leaves failed, or a restore
that fails, is a process without its device state, so the engine stops, as after a broken device,
and the worker is restarted.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

#: The driver entry points the helper needs (CUDA 12.8+ drivers have them).
SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
           "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")
#: CUprocessState.
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATE_NAMES = {RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}
#: How long the lock waits for the process's CUDA calls in flight (the engine makes none: it waits
#: for the helper), in milliseconds.
LOCK_TIMEOUT_MS = 10_000
#: How long the engine waits for a helper, in seconds: a checkpoint or restore copies the process's
#: remaining device state (a few GiB) at host-memory speed.
HELPER_TIMEOUT_S = 120.0
OPS = ("offload", "restore")


class CheckpointError(RuntimeError):
    """A driver call that failed, or a driver without the checkpoint API."""


class _LockArgs(ctypes.Structure):
    """``CUcheckpointLockArgs``: a timeout, then reserved words (64 bytes in all)."""

    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class CheckpointDriver:
    """The checkpoint calls, each checked: a failure raises naming the call and the driver's error."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CheckpointError(f"no CUDA driver (libcuda.so.1): {err}") from err
        missing = [name for name in SYMBOLS if not hasattr(self.lib, name)]
        if missing:
            raise CheckpointError(f"the CUDA driver has no checkpoint API ({', '.join(missing)}): "
                                  "it needs display driver 570+")
        self.call("cuInit", ctypes.c_uint(0))

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise CheckpointError(f"{name} failed: {self.error_name(rc)}")

    def error_name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(ctypes.c_int(rc), ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode()} ({rc})"
        return f"CUresult {rc}"

    def state(self, pid: int) -> int:
        state = ctypes.c_int(-1)
        self.call("cuCheckpointProcessGetState", ctypes.c_int(pid), ctypes.byref(state))
        return state.value

    def offload(self, pid: int, timeout_ms: int) -> None:
        """Lock and checkpoint ``pid``; a checkpoint that fails unlocks it again (it keeps its memory)."""
        self.call("cuCheckpointProcessLock", ctypes.c_int(pid), ctypes.byref(_LockArgs(timeoutMs=timeout_ms)))
        try:
            self.call("cuCheckpointProcessCheckpoint", ctypes.c_int(pid), None)
        except CheckpointError:
            self.call("cuCheckpointProcessUnlock", ctypes.c_int(pid), None)
            raise

    def restore(self, pid: int) -> None:
        """Restore and unlock ``pid`` from whatever state an offload left."""
        found = self.state(pid)
        if found == CHECKPOINTED:
            self.call("cuCheckpointProcessRestore", ctypes.c_int(pid), None)
        if found in (CHECKPOINTED, LOCKED):
            self.call("cuCheckpointProcessUnlock", ctypes.c_int(pid), None)
        if found == FAILED:
            raise CheckpointError("the process's CUDA state failed in an earlier checkpoint or restore")


def device_used_bytes(uuid: str) -> int | None:
    """Device memory in use on the GPU ``uuid``, every process counted (NVML); None without NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        handle, memory = ctypes.c_void_p(), _NvmlMemory()
        if nvml.nvmlDeviceGetHandleByUUID(nvml_uuid(uuid).encode(), ctypes.byref(handle)) != 0:
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.used)
    finally:
        nvml.nvmlShutdown()


def nvml_uuid(uuid: str) -> str:
    """NVML's spelling of a GPU's UUID (``GPU-`` and the hexadecimal form torch reports) (pure)."""
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def run_helper(op: str, pid: int, uuid: str, timeout_ms: int = LOCK_TIMEOUT_MS) -> dict:
    """The helper's work (in the helper process): the result it prints."""
    started = time.perf_counter()
    try:
        driver = CheckpointDriver()
    except CheckpointError as err:  # nothing was done to the process: it runs as it did
        return {"ok": False, "error": str(err), "state": STATE_NAMES[RUNNING]}
    before = device_used_bytes(uuid)
    try:
        driver.offload(pid, timeout_ms) if op == "offload" else driver.restore(pid)
    except CheckpointError as err:
        return {"ok": False, "error": str(err), "state": _state_name(driver, pid)}
    after = device_used_bytes(uuid)
    moved = None if before is None or after is None else abs(before - after)
    return {"ok": True, "moved_bytes": moved, "seconds": time.perf_counter() - started}


def _state_name(driver: CheckpointDriver, pid: int) -> str | None:
    """Where a failed call left the process; None when even that cannot be read."""
    try:
        state = driver.state(pid)
    except CheckpointError:
        return None
    return STATE_NAMES.get(state, str(state))


# --- the engine's side -------------------------------------------------------------------------


@dataclass(frozen=True)
class HelperResult:
    ok: bool
    #: Why not, when not ok (the driver's error, a missing API, a helper that died or hung).
    error: str = ""
    #: Device memory given back (offload) or taken (restore), device-wide; None where NVML is missing.
    moved_bytes: int | None = None
    seconds: float = 0.0
    #: Where a failure left the process ("running": as before the call); None when unknown (a
    #: helper that died or hung), which only a restore can settle.
    state: str | None = None

    @property
    def left_running(self) -> bool:
        """The call failed and the process runs as before it: its CUDA calls go through."""
        return not self.ok and self.state == STATE_NAMES[RUNNING]


def parse_result(stdout: str, stderr: str, returncode: int) -> HelperResult:
    """What a helper's output says (pure): its JSON line, or why there is none."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict) or "ok" not in out:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return HelperResult(False, f"the checkpoint helper exited {returncode} without a result: {tail[:300]}")
    moved = out.get("moved_bytes")
    return HelperResult(bool(out["ok"]), str(out.get("error", "")), None if moved is None else int(moved),
                        float(out.get("seconds", 0.0)), out.get("state"))


def call_helper(op: str, uuid: str, pid: int | None = None, timeout_s: float = HELPER_TIMEOUT_S) -> HelperResult:
    """Runs the helper on ``pid`` (this process by default) and waits for it. The caller must make
    no CUDA call meanwhile: an offload holds them until the restore."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, not {op!r}")
    cmd = [sys.executable, "-I", os.path.abspath(__file__), op, str(os.getpid() if pid is None else pid), uuid]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return HelperResult(False, f"the checkpoint helper ({op}) did not finish in {timeout_s:.0f} s")
    except OSError as err:
        return HelperResult(False, f"the checkpoint helper ({op}) could not start: {err}")
    return parse_result(done.stdout, done.stderr, done.returncode)


def main(argv: list[str]) -> int:
    """``offload|restore PID GPU_UUID``: prints one JSON line; exits 0 when it worked."""
    if len(argv) != 3 or argv[0] not in OPS or not argv[1].isdigit():
        print(json.dumps({"ok": False, "error": f"usage: {{{'|'.join(OPS)}}} PID GPU_UUID, not {argv}"}))
        return 2
    result = run_helper(argv[0], int(argv[1]), argv[2])
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
