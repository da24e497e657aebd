"""The compile and kernel-tuning caches a fleet shares: keyed by every fact that changes what they
hold (the GPU driver included), and a cache written for other facts is ignored, never used.

Real files in a temporary cache root; the tuning decisions land in the kernels' real registries."""

from __future__ import annotations

import json
import logging
import os

import pytest

from graphkeeper.worker.kernels import linear_kernel
from graphkeeper.worker.kernels.linear_kernel import Tile
from graphkeeper.worker.model import tuning
from graphkeeper.worker.model.cache_key import differences, driver_version, key_of, library_versions
from graphkeeper.worker.model.step import KEY_FILE, use_cache_dir

#: A projection shape no model here has: a decision for it can only have come from the file.
ODD_SHAPE = (12347, 4099, "torch.bfloat16", 4)


@pytest.fixture(autouse=True)
def _cache_env(monkeypatch):
    """use_cache_dir points these at the cache it chose: restored after each test."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset")
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")


@pytest.fixture
def no_odd_choice():
    linear_kernel._choices.pop(ODD_SHAPE, None)
    yield
    linear_kernel._choices.pop(ODD_SHAPE, None)


def tuning_facts(driver: str = "550.54.15", device: str = "NVIDIA H200") -> dict:
    return tuning.tuning_facts(device, "9.0", {**library_versions(), "driver": driver}, tuning.kernel_source_digest(),
                               True, [("wo", 4096, 4096, "torch.bfloat16", False)])


def write_tuning(path, key: str, facts: dict | None) -> None:
    data = {"key": key, "linear": [[*ODD_SHAPE, [64, 128, 4, 3]]], "row": []}
    if facts is not None:
        data["facts"] = facts
    path.write_text(json.dumps(data))


def test_the_driver_version_is_read_from_the_kernel_module(tmp_path):
    proprietary = tmp_path / "version"
    proprietary.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                           "GCC version:  gcc version 12.2.0\n")
    assert driver_version(proprietary) == "550.54.15"
    open_module = tmp_path / "open"
    open_module.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n")
    assert driver_version(open_module) == "570.86.15"
    assert driver_version(tmp_path / "absent") == "unknown"
    assert "driver" in library_versions()


def test_the_tuning_key_changes_with_the_driver():
    assert key_of(tuning_facts("550.54.15")) != key_of(tuning_facts("570.86.15"))


def test_a_tuning_file_for_the_same_facts_is_installed(tmp_path, no_odd_choice):
    facts = tuning_facts()
    path = tmp_path / f"tuning-{key_of(facts)}.json"
    write_tuning(path, key_of(facts), facts)
    assert tuning.load(path, key_of(facts), facts)
    assert linear_kernel.choices()[ODD_SHAPE] == Tile(64, 128, 4, 3)


@pytest.mark.parametrize("case", ["other driver", "other gpu", "no facts", "other key"])
def test_a_tuning_file_written_for_other_facts_is_ignored_with_a_warning(tmp_path, caplog, no_odd_choice, case):
    """The file sits at this worker's own path (copied in from another node, say): its decisions
    must not be installed."""
    mine = tuning_facts()
    key = key_of(mine)
    theirs = {"other driver": tuning_facts(driver="535.0.0"), "other gpu": tuning_facts(device="NVIDIA A100"),
              "no facts": None, "other key": mine}[case]
    path = tmp_path / f"tuning-{key}.json"
    write_tuning(path, "0" * 24 if case == "other key" else key, theirs)
    with caplog.at_level(logging.WARNING, logger="graphkeeper.worker.model.tuning"):
        assert not tuning.load(path, key, mine)
    assert ODD_SHAPE not in linear_kernel.choices()
    assert "written for other facts" in caplog.text and "ignored" in caplog.text
    if case == "other driver":
        assert "differs in versions" in caplog.text


def test_a_compile_cache_for_the_same_facts_is_used(tmp_path):
    facts = {"config": {"dim": 64}, "versions": {"driver": "550.54.15"}, "shape": (1, 2)}
    key = key_of(facts)
    first = use_cache_dir(str(tmp_path), key, facts)
    (tmp_path / key / "inductor" / "compiled").write_text("kernels")
    again = use_cache_dir(str(tmp_path), key, facts)  # a restart (the tuple reads back as a list)
    assert again == first
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / key / "inductor")
    assert (tmp_path / key / "inductor" / "compiled").read_text() == "kernels"
    assert json.loads((tmp_path / key / KEY_FILE).read_text()) == {"key": key, "facts": json.loads(json.dumps(facts))}


@pytest.mark.parametrize("case", ["other facts", "no record"])
def test_a_compile_cache_for_another_step_is_set_aside_never_used(tmp_path, caplog, case):
    facts = {"config": {"dim": 64}, "versions": {"driver": "550.54.15"}}
    key = key_of(facts)
    planted = tmp_path / key / "inductor" / "compiled"
    planted.parent.mkdir(parents=True)
    planted.write_text("kernels built for another driver")
    if case == "other facts":
        other = {**facts, "versions": {"driver": "535.0.0"}}
        (tmp_path / key / KEY_FILE).write_text(json.dumps({"key": key, "facts": other}))
    with caplog.at_level(logging.WARNING, logger="graphkeeper.worker.model.step"):
        used = use_cache_dir(str(tmp_path), key, facts)
    assert used == str(tmp_path / key)
    assert not (tmp_path / key / "inductor" / "compiled").exists()  # what Inductor reads holds none of it
    assert os.listdir(tmp_path / key / "inductor") == []
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / key / "inductor")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{key}.ignored-")]
    assert len(aside) == 1 and (aside[0] / "inductor" / "compiled").exists()  # kept for a person to look at
    assert "written for another step" in caplog.text
    assert ("versions" if case == "other facts" else "key.json") in caplog.text


def test_differences_name_the_facts_that_differ():
    assert differences({"a": 1, "b": (1, 2)}, {"a": 1, "b": [1, 2]}) == []
    assert differences({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b", "c"]
    assert differences({"a": 1}, None) == ["(no facts recorded)"]

