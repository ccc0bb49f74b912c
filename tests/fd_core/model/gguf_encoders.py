"""Test-only encoders for the GGUF types gguf-py decodes but cannot encode (K-quants, IQ4_NL/XS).

:func:`quantize` is ``gguf.quants.quantize`` plus Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and
IQ4_XS; :func:`write_gguf` is ``write_tiny_gguf`` using it. The encoders pick scales by simple
max rules (not llama.cpp's error-minimising search), so they are somewhat less accurate than
llama-quantize, but the bytes follow the block layouts ``gguf.quants.dequantize`` reads:
decoding them gives values close to the input (a layout mistake would not).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from fd_core.testing.tiny_model import write_tiny_gguf

_GGUF_QUANTIZE = gguf.quants.quantize
#: IQ4_NL / IQ4_XS code book (``kvalues_iq4nl`` in ggml).
IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def quantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``data`` (rows of whole blocks) as GGUF bytes of ``qtype``, one row of bytes per row."""
    encode = _ENCODERS.get(qtype.name)
    if encode is None:
        return _GGUF_QUANTIZE(data, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = encode(np.asarray(data, dtype=np.float32).reshape(-1, block_size))
    assert blocks.shape[1] == type_size, (qtype.name, blocks.shape)
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // block_size * type_size)


def write_gguf(path: Path, folder: Path, **types: Any) -> Path:
    """``write_tiny_gguf(path, folder, **types)``, with these encoders for the types gguf-py lacks."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", quantize)
        return write_tiny_gguf(path, folder, **types)


def _q2_k(x: np.ndarray) -> np.ndarray:
    scale, low = _scales_and_mins(x.reshape(len(x), 16, 16), levels=3)
    d, sc = _fp16_and_codes(scale, 15)
    dmin, mn = _fp16_and_codes(low, 15)
    q = _codes(x, d * sc, dmin * mn, 0, 3)
    return _cat(sc | mn << 4, _pack(q, 2, 32), d, dmin)


def _q3_k(x: np.ndarray) -> np.ndarray:
    d, sc = _signed_fp16_and_codes(_signed_scale(x.reshape(len(x), 16, 16), 4), 32)
    u = _codes(x, d * sc, 0, -4, 3) + 4  # 3 bits: the low two in qs, the high one in hmask
    sc = sc + 32
    return _cat(_pack(u >> 2, 1, 32), _pack(u & 3, 2, 32), _pack(sc & 15, 4, 8), _pack(sc >> 4, 2, 4), d)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_scales_and_codes(x, levels=15)
    return _cat(d, dmin, scales, _pack(q, 4, 32))


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_scales_and_codes(x, levels=31)
    return _cat(d, dmin, scales, _pack(q >> 4, 1, 32), _pack(q & 15, 4, 32))


def _q6_k(x: np.ndarray) -> np.ndarray:
    d, sc = _signed_fp16_and_codes(_signed_scale(x.reshape(len(x), 16, 16), 32), 128)
    q = _codes(x, d * sc, 0, -32, 31) + 32
    return _cat(_pack(q & 15, 4, 64), _pack(q >> 4, 2, 32), sc.astype(np.int8).view(np.uint8), d)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    d = _fp16(_signed_scale(x[:, None, :], 127))
    return _cat(d, _pack(_nearest_iq4(x, d), 4, 16))


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    d, sc = _signed_fp16_and_codes(_signed_scale(x.reshape(len(x), 8, 32), 127), 32)
    q = _nearest_iq4(x, d * sc)
    sc = sc + 32
    return _cat(d, _pack(sc >> 4, 2, 1), _pack(sc & 15, 4, 1), _pack(q, 4, 16))


def _k_scales_and_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks), codes."""
    scale, low = _scales_and_mins(x.reshape(len(x), 8, 32), levels)
    d, sc = _fp16_and_codes(scale, 63)
    dmin, mn = _fp16_and_codes(low, 63)
    q = _codes(x, d * sc, dmin * mn, 0, levels)
    # bytes 0-3: scales 0-3 + top bits of scales 4-7; 4-7: the same for mins; 8-11: low nibbles of 4-7
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=1)
    return d, dmin, packed, q


def _scales_and_mins(sub: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block step and offset of ``x = step * q - offset`` (offset >= 0, q in 0..levels)."""
    low = np.maximum(-sub.min(axis=2), 0)
    return (sub.max(axis=2) + low) / levels, low


def _signed_scale(sub: np.ndarray, most_negative: int) -> np.ndarray:
    """Per sub-block step that maps the value of largest magnitude to ``-most_negative`` (as ggml)."""
    flat = sub.reshape(-1, sub.shape[-1])
    extreme = flat[np.arange(len(flat)), np.abs(flat).argmax(axis=1)]
    return -extreme.reshape(sub.shape[:-1]) / most_negative


def _fp16_and_codes(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Block scale (fp16) and the unsigned codes 0..top it multiplies to approximate ``values``."""
    d = _fp16(values.max(axis=1, keepdims=True) / top)
    return d, np.clip(np.round(values / _nonzero(d)), 0, top).astype(np.uint8)


def _signed_fp16_and_codes(values: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Block scale (fp16) and signed codes -limit..limit-1 it multiplies to approximate ``values``."""
    d = _fp16(np.abs(values).max(axis=1, keepdims=True) / (limit - 1))
    return d, np.clip(np.round(values / _nonzero(d)), -limit, limit - 1).astype(np.int16)


def _codes(x: np.ndarray, step: np.ndarray, offset: np.ndarray | int, lo: int, hi: int) -> np.ndarray:
    """Integer codes lo..hi of ``x`` for ``step * q - offset`` per sub-block."""
    sub = x.reshape(*step.shape, -1)
    offset = np.broadcast_to(offset, step.shape)
    q = np.round((sub + offset[..., None]) / _nonzero(step)[..., None])
    return np.clip(q, lo, hi).astype(np.int16).reshape(len(x), -1)


def _nearest_iq4(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Index of the IQ4 code book value nearest to ``x / step`` (per sub-block step)."""
    sub = x.reshape(*step.shape, -1, 1) / _nonzero(step)[..., None, None]
    return np.abs(sub - IQ4_VALUES).argmin(axis=-1).astype(np.uint8).reshape(len(x), -1)


def _pack(fields: np.ndarray, bits: int, lanes: int) -> np.ndarray:
    """Bytes holding ``fields`` viewed as (blocks, groups, 8 // bits, lanes): byte [g, j] carries
    field [g, i, j] at bit ``bits * i`` -- the way every ggml block interleaves its bit fields."""
    per_byte = 8 // bits
    shifts = (bits * np.arange(per_byte, dtype=np.uint8)).reshape(1, 1, per_byte, 1)
    grouped = fields.astype(np.uint8).reshape(len(fields), -1, per_byte, lanes) << shifts
    return np.bitwise_or.reduce(grouped, axis=2).reshape(len(fields), -1)


def _cat(*parts: np.ndarray) -> np.ndarray:
    """A block's byte fields in order; float parts are its fp16 scales, stored as two bytes each."""
    return np.concatenate([p.astype(np.float16).view(np.uint8) if p.dtype.kind == "f" else p.astype(np.uint8)
                           for p in parts], axis=1)


def _fp16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to float16, kept as float32 for the arithmetic (the decoder does the same)."""
    return values.astype(np.float16).astype(np.float32)


def _nonzero(values: np.ndarray) -> np.ndarray:
    """``values`` as float32 with zeros replaced by one (an all-zero sub-block codes to zero)."""
    values = values.astype(np.float32)
    return np.where(values == 0, 1, values)


_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}
