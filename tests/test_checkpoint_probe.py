"""bench/checkpoint_probe.py's arithmetic (the probe itself needs a GPU): what the child held awake
and offloaded, against the device once it exited, and nothing claimed without NVML's readings."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from checkpoint_probe import shares  # noqa: E402

MIB = 1 << 20


def test_the_share_is_what_the_child_gave_back_of_what_it_held():
    out = {"used_awake": 9000 * MIB, "used_regions_released": 5000 * MIB, "used_offloaded": 1010 * MIB,
           "used_after_exit": 1000 * MIB}
    got = shares(out)
    assert got["held_awake_bytes"] == 8000 * MIB and got["held_offloaded_bytes"] == 10 * MIB
    assert got["checkpoint_freed_bytes"] == 3990 * MIB
    assert abs(got["released_share"] - 7990 / 8000) < 1e-12


def test_an_offload_that_freed_nothing_reads_as_the_regions_alone():
    out = {"used_awake": 9000 * MIB, "used_regions_released": 5000 * MIB, "used_offloaded": 5000 * MIB,
           "used_after_exit": 1000 * MIB}
    got = shares(out)
    assert got["checkpoint_freed_bytes"] == 0 and got["released_share"] == 0.5


def test_without_nvml_readings_no_share_is_claimed():
    assert shares({"used_awake": None, "used_regions_released": 1, "used_offloaded": 1, "used_after_exit": 1}) == {}
    assert shares({}) == {}
