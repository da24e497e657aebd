"""The GGUF header reader: the same metadata, tensor index and tensor data the ``gguf`` library's
reader gives, for the built-in model and for a file holding every value type; anything it does
not take is left to the library's reader, which refuses a broken file in its own words."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from graphkeeper.worker.model import gguf_checkpoint as ckpt
from graphkeeper.worker.model.catalog import resolve_builtin
from graphkeeper.worker.model.gguf_header import read_header

BUILTIN = Path(resolve_builtin("builtin:smollm2-135m-instruct"))


def library(path: Path) -> tuple[dict, dict]:
    """What the library's reader gives: metadata as ``open_gguf`` builds it, tensors' entries."""
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset - reader.data_offset))
               for t in reader.tensors}
    return metadata, tensors


def same_as_library(path: Path) -> None:
    metadata, tensors, _ = read_header(path)
    want_metadata, want_tensors = library(path)
    assert metadata == want_metadata
    assert {k: type(v) for k, v in metadata.items()} == {k: type(v) for k, v in want_metadata.items()}
    assert {name: (t.type_id, t.dims, t.offset) for name, t in tensors.items()} == want_tensors
    ours, theirs = ckpt.open_gguf(path), gguf.GGUFReader(path)
    assert all(isinstance(t, ckpt.MappedTensor) for t in ours.tensors.values())  # not the library's
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.tensor_type == tensor.tensor_type
        assert mine.data.dtype == tensor.data.dtype and mine.data.shape == tensor.data.shape
        assert np.array_equal(mine.data, tensor.data)


def test_the_builtin_models_file_reads_as_the_library_reads_it():
    same_as_library(BUILTIN)
    file = ckpt.open_gguf(BUILTIN)
    config = ckpt.read_config(file)
    library_file = ckpt.GGUFFile(BUILTIN, file.metadata, {t.name: t for t in gguf.GGUFReader(BUILTIN).tensors})
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):  # Q8_0/Q4 blocks, permuted
        assert np.array_equal(ckpt.dequantized(file, name, config), ckpt.dequantized(library_file, name, config))


def write_every_type(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value, kind in [
        ("t.u8", 200, gguf.GGUFValueType.UINT8), ("t.i8", -100, gguf.GGUFValueType.INT8),
        ("t.u16", 60000, gguf.GGUFValueType.UINT16), ("t.i16", -30000, gguf.GGUFValueType.INT16),
        ("t.u32", 4_000_000_000, gguf.GGUFValueType.UINT32), ("t.i32", -2_000_000_000, gguf.GGUFValueType.INT32),
        ("t.f32", 1e-5, gguf.GGUFValueType.FLOAT32), ("t.bool", True, gguf.GGUFValueType.BOOL),
        ("t.u64", 2**63 + 5, gguf.GGUFValueType.UINT64), ("t.i64", -(2**62), gguf.GGUFValueType.INT64),
        ("t.f64", 0.1, gguf.GGUFValueType.FLOAT64), ("t.str", "héllo ✓", gguf.GGUFValueType.STRING),
    ]:
        writer.add_key_value(name, value, kind)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_type_reads_as_the_library_reads_it(tmp_path):
    path = tmp_path / "types.gguf"
    write_every_type(path)
    same_as_library(path)


@pytest.mark.parametrize("damage", ["truncated-metadata", "truncated-data", "bad-magic", "empty", "big-endian"])
def test_a_file_it_does_not_take_goes_to_the_librarys_reader(tmp_path, damage):
    whole = tmp_path / "whole.gguf"
    write_every_type(whole)
    data = whole.read_bytes()
    broken = {"truncated-metadata": data[:100], "truncated-data": data[:-8], "bad-magic": b"GGUX" + data[4:],
              "empty": b"", "big-endian": data[:4] + (3).to_bytes(4, "big") + data[8:]}[damage]
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(broken)
    assert read_header(path) is None
    with pytest.raises(ckpt.GGUFError, match=f"{damage}.gguf: not a readable GGUF file \\("):  # the library's words
        ckpt.open_gguf(path)
