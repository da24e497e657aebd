"""Kernel tuning the worker ships per GPU model: an entry applies to a start on the same GPU, PDL
switch and projection shapes whatever its library versions, is skipped (with a warning) when its
tiles are no longer candidates or its table does not parse, and is installed without timing
anything. Real table files in a temporary directory; the decisions land in the kernels' real
registries; ``bench/ship_tuning.py`` runs as a process."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphkeeper.worker.kernels import linear_kernel, row_kernel
from graphkeeper.worker.kernels.linear_kernel import Tile
from graphkeeper.worker.kernels.row_kernel import RowTile
from graphkeeper.worker.model import shipped_tuning, tuning
from graphkeeper.worker.model.cache_key import library_versions
from graphkeeper.worker.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
#: A shape no model here has: a decision for it can only have come from a table.
ODD = (12347, 4096, "torch.bfloat16")


@pytest.fixture
def registries():
    """The kernels' decision registries, restored after the test."""
    linear, rows = dict(linear_kernel._choices), dict(row_kernel._choices)
    yield
    linear_kernel._choices.clear()
    linear_kernel._choices.update(linear)
    row_kernel._choices.clear()
    row_kernel._choices.update(rows)


def facts(device: str = "NVIDIA H100 80GB HBM3", pdl: bool = True, driver: str = "580.1",
          shapes: list | None = None) -> dict:
    shapes = shapes if shapes is not None else [("wo", 2048, 2048, "torch.bfloat16", False)]
    return tuning.tuning_facts(device, "9.0", {**library_versions(), "driver": driver}, "source-digest", pdl, shapes)


def record(f: dict, linear_tile: list | None = (32, 256, 8, 3), row_tile: tuple = (4, 4)) -> dict:
    return {"key": "k", "facts": f, "linear": [[*ODD, 4, None if linear_tile is None else list(linear_tile)]],
            "row": [[row_kernel.PLAIN, *ODD, *row_tile]]}


def write_table(directory: Path, *records: dict, name: str = "gpu.json") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps({"entries": [{"facts": r["facts"], "linear": r["linear"], "row": r["row"]}
                                            for r in records]}))
    return path


def test_an_entry_applies_whatever_the_library_versions_and_kernel_source():
    mine = facts(driver="590.0")
    mine["source"] = "another digest"
    assert shipped_tuning.matches(mine, facts())


@pytest.mark.parametrize("other", ["device", "pdl", "shapes", "capability"])
def test_an_entry_for_another_gpu_pdl_switch_or_shape_does_not_apply(other):
    theirs = {"device": facts(device="NVIDIA H200"), "pdl": facts(pdl=False),
              "shapes": facts(shapes=[("wo", 4096, 4096, "torch.bfloat16", False)]),
              "capability": {**facts(), "capability": "8.0"}}[other]
    assert not shipped_tuning.matches(facts(), theirs)
    assert shipped_tuning.matches(facts(), facts())


def test_lookup_finds_the_entry_for_the_start_among_others(tmp_path):
    write_table(tmp_path, record(facts(device="NVIDIA H200")), record(facts(), row_tile=(8, 2)))
    entry = shipped_tuning.lookup(facts(), tmp_path)
    assert entry is not None and entry["row"][0][-2:] == [8, 2]
    assert shipped_tuning.lookup(facts(device="NVIDIA A100"), tmp_path) is None
    assert shipped_tuning.lookup(facts(), tmp_path / "absent") is None


def test_an_entry_with_a_tile_the_kernels_no_longer_offer_is_skipped_with_a_warning(tmp_path, caplog):
    assert Tile(64, 128, 4, 7) not in linear_kernel.FEW_ROWS
    write_table(tmp_path, record(facts(), linear_tile=(64, 128, 4, 7)))
    with caplog.at_level(logging.WARNING, logger=shipped_tuning.__name__):
        assert shipped_tuning.lookup(facts(), tmp_path) is None
    assert "not a candidate" in caplog.text
    assert RowTile(3, 4) not in row_kernel.CANDIDATES
    assert "row tile" in shipped_tuning.unusable(record(facts(), row_tile=(3, 4)))
    assert shipped_tuning.unusable(record(facts())) == ""


def test_a_table_that_does_not_parse_is_skipped_with_a_warning_and_the_next_one_read(tmp_path, caplog):
    (tmp_path / "a-broken.json").write_text("{not json")
    write_table(tmp_path, record(facts()), name="b-good.json")
    with caplog.at_level(logging.WARNING, logger=shipped_tuning.__name__):
        assert shipped_tuning.lookup(facts(), tmp_path) is not None
    assert "a-broken.json unreadable" in caplog.text


def test_adding_a_record_replaces_the_entry_for_the_same_gpu_and_shapes_only():
    h200 = record(facts(device="NVIDIA H200"))
    table = shipped_tuning.add(shipped_tuning.add({"entries": []}, h200), record(facts()))
    table = shipped_tuning.add(table, record(facts(driver="600.0"), row_tile=(16, 8)))
    assert [e["facts"]["device"] for e in table["entries"]] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    assert table["entries"][1]["row"][0][-2:] == [16, 8]
    assert set(table["entries"][1]) == {"facts", "linear", "row"}


def test_the_table_is_named_for_the_gpu():
    assert shipped_tuning.table_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    assert shipped_tuning.table_name("NVIDIA H200 (NVL)") == "nvidia-h200-nvl.json"


def test_a_start_installs_a_matching_entry_and_times_nothing(tmp_path, monkeypatch, registries):
    """``install_shipped`` with a real model's projections (on the CPU its compile step has nothing
    to compile): the table's decisions land in the kernels' registries; no candidate is timed."""
    model = load_model("random:tiny", device="cpu", dtype="float32", max_positions=64).model
    shapes = tuning.model_shapes(model)
    mine = facts(shapes=tuning.shape_facts(shapes, True, torch.float32))
    monkeypatch.setattr(shipped_tuning, "TABLE_DIR", tmp_path)
    write_table(tmp_path, record(mine, row_tile=(1, 2)))
    timed = len(linear_kernel.measurements), len(row_kernel.measurements)
    linear_kernel._choices.pop((*ODD, 4), None)
    assert tuning.install_shipped(shapes, mine, torch.float32, True)
    assert linear_kernel.choices()[(*ODD, 4)] == Tile(32, 256, 8, 3)
    assert row_kernel.choices()[(row_kernel.PLAIN, *ODD)] == RowTile(1, 2)
    assert (len(linear_kernel.measurements), len(row_kernel.measurements)) == timed
    other = {**mine, "device": "NVIDIA A100"}
    assert not tuning.install_shipped(shapes, other, torch.float32, True)


def test_ship_tuning_adds_a_start_s_tuning_file_to_its_gpu_s_table(tmp_path):
    cache = tmp_path / "caches" / "llama-1b" / "key"
    cache.mkdir(parents=True)
    (cache / "tuning-abc.json").write_text(json.dumps(record(facts())))
    (cache / "tuning-bad.json").write_text("{")
    tables = tmp_path / "tables"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ship_tuning.py"), "--table-dir", str(tables),
                           str(tmp_path / "caches")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stderr and "tuning-bad.json" in done.stderr
    table = tables / "nvidia-h100-80gb-hbm3.json"
    assert shipped_tuning.lookup(facts(), tables) == json.loads(table.read_text())["entries"][0]


def test_every_shipped_table_parses_and_every_entry_is_usable():
    tables = sorted(shipped_tuning.TABLE_DIR.glob("*.json"))
    for path in tables:
        entries = json.loads(path.read_text())["entries"]
        assert entries, path
        for entry in entries:
            assert shipped_tuning.unusable(entry) == "", (path, entry["facts"]["shapes"])
            assert path.name == shipped_tuning.table_name(entry["facts"]["device"])
