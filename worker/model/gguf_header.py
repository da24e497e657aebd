"""A GGUF file's metadata and tensor index, read straight from its header with ``struct``.

The ``gguf`` library's reader makes a numpy view of every part of every metadata value: for a
vocabulary of 49,152 tokens and as many merges that is 2-3 s of a CPU, and both worker
processes read the metadata before they serve (the worker process to check ``--model`` and build
the tokenizer, the engine core to size the KV cache and build its tokenizer). This reads the same
values in about a tenth of a second, and maps each tensor's data as the library's reader does
(``tensor_data``), for the library's dequantizers.

Anything but a well-formed little-endian GGUF version 2 or 3 whose tensors all lie inside the
file (a bad magic, a truncation, a duplicate key, an unknown type, text that is not UTF-8) reads
as None here, and the caller falls back to the library's reader: a broken file is refused in the
very words it always was.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
#: Scalar value types: struct format (little-endian) and numpy dtype, by GGUF type id.
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
           5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
           11: ("<q", np.int64), 12: ("<d", np.float64)}
UINT32 = 4


class HeaderTensor(NamedTuple):
    """A tensor's entry in the index: its GGML type id, its dimensions (GGUF order) and where its
    data starts, relative to the data section. No data: the weights are read by ``open_gguf``."""

    type_id: int
    dims: tuple[int, ...]
    offset: int


class _Malformed(Exception):
    """Anything this reader does not take; the library's reader then says what is wrong."""


class _Cursor:
    """Reads little-endian values from a buffer, moving forward."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        try:
            value = struct.unpack_from(fmt, self.buf, self.at)[0]
        except struct.error:
            raise _Malformed("truncated") from None
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        end = self.at + size
        if end > len(self.buf):
            raise _Malformed("truncated string")
        try:
            text = bytes(self.buf[self.at:end]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Malformed("not UTF-8") from None
        self.at = end
        return text

    def value(self, type_id: int) -> Any:
        if type_id == STRING:
            return self.string()
        if type_id == ARRAY:
            return self.array()
        if type_id not in SCALARS:
            raise _Malformed(f"value type {type_id}")
        return self.unpack(SCALARS[type_id][0])

    def array(self) -> list:
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type == STRING:
            return [self.string() for _ in range(count)]
        if item_type not in SCALARS:  # nested arrays: the library's reader has its own reading of them
            raise _Malformed(f"array of type {item_type}")
        dtype = np.dtype(SCALARS[item_type][1]).newbyteorder("<")
        if self.at + count * dtype.itemsize > len(self.buf):
            raise _Malformed("truncated array")
        items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.at).tolist()
        self.at += count * dtype.itemsize
        return items


class Header(NamedTuple):
    """A GGUF file's metadata by key (as the library's ``field.contents()`` gives it, without its
    ``GGUF.*`` entries), its tensors by name, and where the data section starts."""

    metadata: dict[str, Any]
    tensors: dict[str, HeaderTensor]
    data_start: int


def read_header(path: Path) -> Header | None:
    """The header of the GGUF file at ``path``, or None when the file is not one this reader
    takes (the caller then uses the library's reader)."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(buf)
            except _Malformed:
                return None
    except (OSError, ValueError):  # unreadable, or empty (mmap refuses a file of 0 bytes)
        return None


def _parse(buf: Any) -> Header:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf)
    if bytes(buf[:4]) != MAGIC:
        raise _Malformed("magic")
    cur.at = 4
    if cur.unpack("<I") not in VERSIONS:
        raise _Malformed("version or byte order")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        type_id = cur.unpack("<I")
        if key in metadata or key.startswith("GGUF."):
            raise _Malformed(f"key {key}")
        metadata[key], types[key] = cur.value(type_id), type_id
    tensors: dict[str, HeaderTensor] = {}
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        tensor = HeaderTensor(cur.unpack("<I"), dims, cur.unpack("<Q"))
        if name in tensors:
            raise _Malformed(f"tensor {name}")
        tensors[name] = tensor
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and types["general.alignment"] != UINT32 or alignment <= 0 \
            or alignment & (alignment - 1):
        raise _Malformed("alignment")
    data_start = -(-cur.at // alignment) * alignment
    for tensor in tensors.values():
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
        except (ValueError, KeyError):
            raise _Malformed("tensor type") from None
        elements = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
        if not tensor.dims or tensor.dims[0] % block or data_start + tensor.offset + elements * type_size // block \
                > len(buf):
            raise _Malformed("tensor data")
    return Header(metadata, tensors, data_start)


def tensor_data(mapped: np.ndarray, header: Header, name: str) -> np.ndarray:
    """Tensor ``name``'s data as the library's reader maps it: (rows, columns) of its dtype for the
    plain types, (rows, bytes per row) of uint8 blocks for the quantized ones (``mapped``: the
    whole file as a uint8 memory map)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    entry = header.tensors[name]
    kind = GGMLQuantizationType(entry.type_id)
    block, type_size = GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(entry.dims))
    start = header.data_start + entry.offset
    raw = mapped[start:start + int(np.prod(entry.dims, dtype=np.int64)) * type_size // block]
    if kind.name in PLAIN:
        return raw.view(PLAIN[kind.name]).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, kind))


#: Tensor types the library maps as arrays of their own dtype (the rest: uint8 blocks).
PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}
