"""The fast GGUF reader gives what gguf-py's GGUFReader gives, and names what it cannot read."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from fd_core.model.gguf_file import read_gguf
from fd_core.model.loader import resolve_alias
from fd_core.testing.tiny_model import make_tiny_llama
from tests.fd_core.model.gguf_encoders import write_gguf


def _assert_same_as_gguf_py(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in theirs.fields.items()}
    assert ours.metadata == expected
    assert {key: type(value) for key, value in ours.metadata.items()} == {k: type(v) for k, v in expected.items()}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type and mine.shape == tuple(int(n) for n in reference.shape)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_the_default_model_reads_as_gguf_py_reads_it() -> None:
    _assert_same_as_gguf_py(Path(resolve_alias("smollm2-135m-instruct")))


def test_plain_and_quantized_tensors_read_as_gguf_py_reads_them(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "wide", hidden=256, intermediate=256)
    types = {"blk.0.ffn_up.weight": "Q4_K", "blk.0.ffn_down.weight": "Q8_0", "blk.1.ffn_up.weight": "F16"}
    _assert_same_as_gguf_py(write_gguf(tmp_path / "mixed.gguf", folder, tensor_types=types))


def test_what_it_cannot_read_is_named(tmp_path: Path) -> None:
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf(not_gguf)
    big_endian = tmp_path / "big.gguf"
    big_endian.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(ValueError, match="big-endian"):
        read_gguf(big_endian)
    unknown_type = tmp_path / "odd.gguf"
    key = b"general.odd"
    unknown_type.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + struct.pack("<I", 99))
    with pytest.raises(ValueError, match="'general.odd' has unknown value type 99"):
        read_gguf(unknown_type)
