"""Reading a GGUF file's metadata and tensor table, fast, with its tensor data mapped from disk.

gguf-py's ``GGUFReader`` builds a numpy view per item of every metadata array, which costs ~2.5 s
for a 49k-token vocabulary (the default model's): paid by the engine and by the server's front end
at every start. This reader walks the header with ``struct`` over one ``mmap`` instead (~0.1 s) and
gives the same values: ``metadata`` maps each key (and ``GGUF.version``, ``GGUF.tensor_count``,
``GGUF.kv_count``, as ``GGUFReader.fields``) to what ``ReaderField.contents()`` returns, and
each tensor's ``data`` is the same read-only array (``GGUFReader``'s shape and dtype) over the
file. gguf-py still names the tensor types and decodes the quantized blocks.

Only little-endian files (what llama.cpp writes on every platform it runs on) are read; a
big-endian file or an unknown value type raises ``ValueError`` naming it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

_MAGIC: Final = b"GGUF"
_DEFAULT_ALIGNMENT: Final = 32

#: GGUF value types (``gguf.GGUFValueType``) with a fixed size: their struct code.
_SCALARS: Final = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING: Final = 8
_ARRAY: Final = 9

#: Tensor types stored as plain numbers (``GGUFReader`` gives them their dtype, the rest bytes).
_PLAIN_TENSOR_DTYPES: Final = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                               "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of the file: ``shape`` in GGUF order (``ne``: fastest-varying first), ``data``
    in numpy order (that shape reversed; for quantized types, the last axis in bytes)."""

    name: str
    tensor_type: Any        # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GgufFile:
    """A GGUF file's metadata values (by key) and tensors (in file order)."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]


class _Cursor:
    """Reads little-endian values one after another from a buffer."""

    def __init__(self, buffer: Any, offset: int = 0) -> None:
        self.buffer = buffer
        self.offset = offset

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buffer, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        start, self.offset = self.offset, self.offset + size
        return bytes(self.buffer[start:self.offset]).decode("utf-8")

    def value(self, value_type: int, key: str) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type not in _SCALARS:
                raise ValueError(f"metadata key {key!r}: arrays of value type {item_type} are not supported")
            dtype = np.dtype("<" + _SCALARS[item_type])
            items = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += dtype.itemsize * count
            return items.tolist()
        raise ValueError(f"metadata key {key!r} has unknown value type {value_type}")


def read_gguf(path: str | Path) -> GgufFile:
    """The metadata and tensors of the GGUF file at ``path`` (its data stays mapped, read-only).

    Raises ``OSError`` when the file cannot be read and ``ValueError`` when it is not a GGUF file
    this reader understands (the message says why).
    """
    import gguf

    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if Path(path).stat().st_size else b""
    if buffer[:4] != _MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    cursor = _Cursor(buffer, 4)
    version = cursor.scalar("I")
    if version & 0xFFFF == 0 and version:
        raise ValueError("a big-endian GGUF file; only little-endian ones are read")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_keys = cursor.scalar("Q"), cursor.scalar("Q")
    # GGUFReader lists the header's counts as fields too
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": num_tensors, "GGUF.kv_count": num_keys}
    for _ in range(num_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"), key)
    table = []
    for _ in range(num_tensors):
        name = cursor.string()
        shape = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        table.append((name, gguf.GGMLQuantizationType(cursor.scalar("I")), shape, cursor.scalar("Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment}")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, tensor_type, shape, offset in table:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(GgufTensor(name, tensor_type, shape, _tensor_data(buffer, data_start + offset,
                                                                          tensor_type, shape)))
    return GgufFile(metadata, tensors)


def _tensor_data(buffer: Any, offset: int, tensor_type: Any, shape: tuple[int, ...]) -> np.ndarray:
    import gguf

    numpy_shape = tuple(reversed(shape))
    count = int(np.prod(shape, dtype=np.int64))
    dtype = _PLAIN_TENSOR_DTYPES.get(tensor_type.name)
    if dtype is None:
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        numpy_shape = gguf.quants.quant_shape_to_byte_shape(numpy_shape, tensor_type)
        dtype, count = np.uint8, count * type_size // block_size
    return np.frombuffer(buffer, dtype, count, offset).reshape(numpy_shape)
