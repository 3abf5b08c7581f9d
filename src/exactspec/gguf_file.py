"""A GGUF file's header and tensors, read in one pass with the tensors memory-mapped.

``gguf.GGUFReader`` builds a memory-mapped view for every part of every field, so a file
with a 151,936-token vocabulary and its merges (Qwen2.5) takes 12 seconds to open; this
reader walks the same layout (the GGUF specification, version 2 and 3: magic, version,
tensor and field counts, the fields, the tensor infos, the aligned data) with ``struct``
and decodes the arrays with numpy, in a fraction of a second. The tensors it returns have
gguf-py's shapes and dtypes (F32, F16 and the integer types as their numpy dtype, every other
type as ``uint8`` rows of its blocks), so ``gguf.quants.dequantize`` takes their data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"

# GGUF value types (gguf.GGUFValueType): their struct format, or a name for the others
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_TENSOR_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Tensor:
    """One tensor: its name, its dims in GGUF order (``[cols, rows]`` for a matrix),
    its type (``gguf.GGMLQuantizationType``: ``.name`` is ggml's, e.g. ``Q4_K``) and its
    bytes, memory-mapped read-only (rows reversed from ``shape``; block types as ``uint8``
    rows of blocks)."""
    name: str
    shape: tuple[int, ...]
    tensor_type: object
    data: np.ndarray


class GGUFFile:
    """The fields and tensors of the GGUF file at ``path``.

    Attributes:
        fields: every field by key: numbers, bools and strings as Python values, arrays as
            lists (of str for string arrays, else of numbers).
        tensors: the tensors in the file's order (:class:`Tensor`).
    Raises:
        ValueError: for a file that is not GGUF (naming what it starts with), another
            version than 2 or 3, or one cut short.
    """

    def __init__(self, path: Path | str) -> None:
        import gguf

        self.path = Path(path)
        buffer = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = buffer
        view = memoryview(buffer)
        if bytes(view[:4]) != MAGIC:
            raise ValueError(f"{str(self.path)!r} is not a GGUF file: it starts with "
                             f"{bytes(view[:4])!r}, not {MAGIC!r}")
        try:
            version, n_tensors, n_fields = struct.unpack_from("<IQQ", view, 4)
            if version not in (2, 3):
                raise ValueError(f"{str(self.path)!r} is GGUF version {version}; versions 2 "
                                 "and 3 are read")
            self._view, self._at = view, 24
            self.fields: dict[str, object] = {}
            for _ in range(n_fields):
                key = self._string()
                self.fields[key] = self._value(self._unpack("<I"))
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                dims = self._unpack(f"<{self._unpack('<I')}Q", tuple)
                infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        except struct.error as error:
            raise ValueError(f"{str(self.path)!r} is cut short: {error}") from error
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, dims, type_number, offset in infos:
            tensor_type = gguf.GGMLQuantizationType(type_number)
            block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
            rows = tuple(reversed(dims))
            dtype = _TENSOR_DTYPES.get(tensor_type.name)
            if dtype is None:
                shape, dtype = (*rows[:-1], rows[-1] // block * block_bytes), np.uint8
            else:
                shape = rows
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            begin = start + offset
            if begin + size > buffer.size:
                raise ValueError(f"{str(self.path)!r} is cut short: tensor {name} ends at byte "
                                 f"{begin + size} of {buffer.size}")
            data = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=begin)
            self.tensors.append(Tensor(name, dims, tensor_type, data))
        del self._view

    def _unpack(self, fmt: str, kind=None):
        values = struct.unpack_from(fmt, self._view, self._at)
        self._at += struct.calcsize(fmt)
        return values if kind is tuple else values[0]

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self._view[self._at:self._at + length]).decode("utf-8", errors="replace")
        self._at += length
        return text

    def _value(self, value_type: int):
        if value_type in _SCALARS:
            return self._unpack("<" + _SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"{str(self.path)!r} has a field of unknown type {value_type}")
        item_type, count = self._unpack("<IQ", tuple)
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            items = np.frombuffer(self._view, dtype=dtype, count=count, offset=self._at)
            self._at += count * dtype.itemsize
            return items.tolist()
        return [self._value(item_type) for _ in range(count)]
