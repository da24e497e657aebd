"""Does a CUDA process give back all its device memory through the driver's checkpoint, and replay
the same graphs after the restore, with sleepable regions released around it as sleep releases them?

The mechanism a sleeping worker's context offload rests on (``worker/engine/context_offload.py``),
alone, in about ten seconds, so that a failure of the worker's sleep can be told apart from a driver
or container that does not allow the checkpoint. On the GPU machine:

1. a child process (``--child``) reserves and maps ``--gib`` GiB through ``model/sleep_memory.py``
   and captures ``bench/vmm_probe.py``'s graph over it (a linear layer whose weight is in the
   range, a reduction over the range), with a reduction over ordinary torch memory beside;
2. the child releases its region's physical memory (the contents to pinned host memory), as sleep
   does before the checkpoint;
3. this process runs the checkpoint helper on the child (``offload``): lock and checkpoint; device
   memory is read device-wide from NVML before and after;
4. it runs the helper again (``restore``): restore and unlock; the child maps its region again,
   copies the contents back, replays both graphs and compares with the outputs before, exactly.

    python3 bench/checkpoint_probe.py --out $out/checkpoint-probe-h200.json   # H200: prints and writes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vmm_probe, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker" / "engine"))
import context_offload  # noqa: E402  (stdlib only: this process never touches CUDA itself)

GIB = 1 << 30


def child(gib: float) -> None:
    """The CUDA process: answers one JSON line per command read from stdin (sleep, wake)."""
    import torch
    from vmm_probe import RegionGraph  # beside this file

    from graphkeeper.worker.model.sleep_memory import SleepableRegion

    torch.zeros(1, device="cuda")
    region = SleepableRegion(int(gib * GIB), "probe", torch.device("cuda"))
    graph = RegionGraph(region, plain_bytes=256 << 20)  # and 256 MiB of ordinary torch memory
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    _say({"ready": True, "uuid": uuid, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    for line in sys.stdin:
        command = line.strip()
        if command == "sleep":
            released = region.release(keep=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            _say({"region_released_bytes": released})
        elif command == "wake":
            t0 = time.perf_counter()
            kept = region.restore()
            same = graph.same()
            _say({"contents_kept": kept, "replay_after_restore_equal": same,
                  "wake_and_replay_s": time.perf_counter() - t0})
        else:
            return


def _say(out: dict) -> None:
    print(json.dumps(out), flush=True)


def probe(gib: float) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--gib", str(gib)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            return {"error": f"the CUDA child exited {proc.wait(timeout=60)} before it was ready"}
        ready = json.loads(line)
        uuid = ready["uuid"]
        out: dict = {"gpu": ready["gpu"], "torch": ready["torch"], "range_bytes": int(gib * GIB),
                     "used_awake": context_offload.device_used_bytes(uuid)}
        out.update(_ask(proc, "sleep"))
        out["used_regions_released"] = context_offload.device_used_bytes(uuid)
        offload = context_offload.call_helper("offload", uuid, pid=proc.pid)
        out.update(offload_ok=offload.ok, offload_error=offload.error, offload_s=offload.seconds,
                   used_offloaded=context_offload.device_used_bytes(uuid))
        time.sleep(1.0)
        restore = context_offload.call_helper("restore", uuid, pid=proc.pid)
        out.update(restore_ok=restore.ok, restore_error=restore.error, restore_s=restore.seconds,
                   used_restored=context_offload.device_used_bytes(uuid))
        out.update(_ask(proc, "wake") if restore.ok or not offload.ok else {"replay_after_restore_equal": False})
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    out["used_after_exit"] = context_offload.device_used_bytes(uuid)
    return out | shares(out)


def shares(out: dict) -> dict:
    """What the child held awake, what it still held offloaded, and the share given back, all
    against the device once the child exited (pure; None where NVML gave no reading)."""
    keys = ("used_awake", "used_regions_released", "used_offloaded", "used_after_exit")
    if any(out.get(k) is None for k in keys):
        return {}
    awake, regions, offloaded, gone = (out[k] for k in keys)
    return {"held_awake_bytes": awake - gone, "held_offloaded_bytes": offloaded - gone,
            "checkpoint_freed_bytes": regions - offloaded,
            "released_share": (awake - offloaded) / max(awake - gone, 1)}


def _ask(proc: subprocess.Popen, command: str) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.child:
        child(args.gib)
        return 0
    result = probe(args.gib)
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result.get("offload_ok") and result.get("replay_after_restore_equal") else 1


if __name__ == "__main__":
    sys.exit(main())
