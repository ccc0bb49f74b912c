"""Weights kept in blocks of 32 low-bit codes (GGUF's Q4_0, Q4_1, Q8_0), as the matmul reads them.

A :class:`BlockQuantized` is a ``[rows, cols]`` matrix (rows = output features, HF's ``[out, in]``)
whose row ``j`` is stored in blocks of 32 values along ``cols``: value ``32 b + i`` is
``scales[j, b] * q_i + mins[j, b]``. 4-bit codes pack two values a byte in GGUF's order (the low
nibbles of a block's 16 bytes are values 0-15, the high nibbles 16-31); 8-bit codes are int8.
Scales and mins are float32, so :meth:`dequantize` equals GGUF's dequantization bit for bit
(a half-precision scale times a small integer is exact in float32).

:func:`round_to_bfloat16` gives the values a bfloat16 weight (``linear_weights = "bfloat16"``) holds;
:func:`quantize_int8_blocks` the int8 blocks an input becomes with ``linear_inputs = "int8"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

BLOCK: Final = 32


@dataclass(frozen=True, slots=True)
class BlockQuantized:
    """A ``[rows, cols]`` matrix in 4- or 8-bit blocks of 32 along ``cols`` (see the module docstring)."""

    bits: int             # 4 or 8
    codes: np.ndarray     # uint8 [rows, cols * bits / 8]
    scales: np.ndarray    # float32 [rows, cols / 32]
    mins: np.ndarray      # float32 [rows, cols / 32]

    def __post_init__(self) -> None:
        rows, blocks = self.scales.shape
        if (self.bits not in (4, 8) or self.codes.dtype != np.uint8
                or self.codes.shape != (rows, blocks * self.bits * 4)):
            raise ValueError(f"codes {self.codes.dtype}{list(self.codes.shape)} do not hold {rows} rows of "
                             f"{blocks} {self.bits}-bit blocks")
        if self.mins.shape != self.scales.shape:
            raise ValueError(f"mins {list(self.mins.shape)} and scales {list(self.scales.shape)} differ")

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix it stands for."""
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and mins)."""
        return self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    def int_codes(self) -> np.ndarray:
        """The codes as integers ``[rows, cols]`` (0..15 for 4 bits, -128..127 for 8)."""
        if self.bits == 8:
            return self.codes.view(np.int8)
        rows, blocks = self.scales.shape
        packed = self.codes.reshape(rows, blocks, 1, BLOCK // 2)
        nibbles = (packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        return nibbles.reshape(rows, blocks * BLOCK)

    def dequantize(self) -> np.ndarray:
        """The float32 matrix ``[rows, cols]``."""
        rows, blocks = self.scales.shape
        q = self.int_codes().reshape(rows, blocks, BLOCK).astype(np.float32)
        return (q * self.scales[..., None] + self.mins[..., None]).reshape(rows, blocks * BLOCK)

    def scaled(self, factor: float) -> BlockQuantized:
        """The matrix times ``factor`` (exact for a power of two)."""
        factor = np.float32(factor)
        return BlockQuantized(self.bits, self.codes, self.scales * factor, self.mins * factor)

    def take_rows(self, order: np.ndarray) -> BlockQuantized:
        """Rows reordered: row ``i`` of the result is row ``order[i]``."""
        return BlockQuantized(self.bits, np.ascontiguousarray(self.codes[order]),
                              np.ascontiguousarray(self.scales[order]), np.ascontiguousarray(self.mins[order]))

    def widened(self) -> BlockQuantized:
        """The same values with 8-bit codes (a 4-bit matrix's codes 0..15 as int8)."""
        if self.bits == 8:
            return self
        return BlockQuantized(8, self.int_codes().astype(np.int8).view(np.uint8), self.scales, self.mins)


def stack_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """One matrix of ``parts``' rows in order (a fused q/k/v or gate/up weight); mixed widths are
    widened to 8 bits."""
    bits = {part.bits for part in parts}
    if len(bits) > 1:
        parts = [part.widened() for part in parts]
    return BlockQuantized(parts[0].bits, *(np.concatenate([getattr(p, field) for p in parts])
                                           for field in ("codes", "scales", "mins")))


def from_gguf_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> BlockQuantized:
    """A ``[rows, cols]`` matrix from a GGUF tensor's raw bytes (``kind`` Q4_0, Q4_1 or Q8_0)."""
    rows, cols = shape
    layout = {"Q4_0": (2, 0, 4), "Q4_1": (2, 2, 4), "Q8_0": (2, 0, 8)}   # scale bytes, min bytes, bits
    if kind not in layout or cols % BLOCK:
        raise ValueError(f"cannot keep a {kind} tensor of shape {list(shape)} in blocks of {BLOCK}")
    scale_bytes, min_bytes, bits = layout[kind]
    code_bytes = BLOCK * bits // 8
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, -1)
    if blocks.shape[-1] != scale_bytes + min_bytes + code_bytes:
        raise ValueError(f"{kind} blocks of {blocks.shape[-1]} bytes, expected {scale_bytes + min_bytes + code_bytes}")

    def half(start: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)

    scales = half(0)
    if kind == "Q4_1":
        mins = half(2)
    elif kind == "Q4_0":   # d * (q - 8) = d * q - 8 d, exact
        mins = scales * np.float32(-8)
    else:
        mins = np.zeros_like(scales)
    codes = np.ascontiguousarray(blocks[..., scale_bytes + min_bytes:]).reshape(rows, -1)
    return BlockQuantized(bits, codes, scales, mins)


def round_to_bfloat16(matrix: np.ndarray) -> np.ndarray:
    """``matrix`` rounded to bfloat16 (to nearest, ties to even; NaN becomes the quiet NaN), as float32."""
    bits = np.ascontiguousarray(matrix, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(matrix), np.float32(np.nan), rounded.view(np.float32)).astype(np.float32)



def quantize_int8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[..., k]`` as int8 codes ``[..., k]`` and float32 scales ``[..., k / 32]``: per block of
    32, scale ``d = max|x| / 127`` and codes ``rint(x * (1 / d))`` (0 where ``d`` is 0), every step in
    float32, as ``csrc/int8_inputs.h`` computes them (the same bits)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    scales = np.abs(blocks).max(axis=-1) / np.float32(127)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    codes = np.rint(blocks * inverse[..., None]).astype(np.int8)
    return codes.reshape(x.shape), scales


def int8_block_values(x: np.ndarray) -> np.ndarray:
    """The values ``d * q`` that :func:`quantize_int8_blocks` leaves of ``x`` (float32, ``x``'s shape)."""
    codes, scales = quantize_int8_blocks(x)
    values = codes.reshape(*scales.shape, BLOCK).astype(np.float32) * scales[..., None]
    return values.reshape(codes.shape)


#: Largest magnitude of a per-channel int8 weight code (``linear_weights = "int8"``): 64, not 127,
#: so that on CPUs without VNNI the integer GEMM's pairs of u8 x s8 products (``vpmaddubsw``, which
#: saturates at 16 bits) stay exact: 2 x 255 x 64 < 32767. Inputs get the full 8 bits.
INT8_WEIGHT_LEVELS = 64


def quantize_int8_channels(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A ``[out, in]`` weight as int8 codes ``[out, in]`` and float32 scales ``[out]``: per output
    channel (row), scale ``s = max|w| / 64`` and codes ``rint(w * (1 / s))`` in [-64, 64] (0 where
    ``s`` is 0), every step in float32."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    scales = np.abs(weight).max(axis=1) / np.float32(INT8_WEIGHT_LEVELS)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    codes = np.clip(np.rint(weight * inverse[:, None]), -INT8_WEIGHT_LEVELS, INT8_WEIGHT_LEVELS).astype(np.int8)
    return codes, scales


def quantize_uint8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[..., k]`` as uint8 codes, float32 scales ``[...]`` and int32 zero points ``[...]``:
    per row, with ``lo = min(0, min x)`` and ``hi = max(0, max x)``, scale ``s = (hi - lo) / 255``,
    zero point ``z = rint(-lo * (1 / s))`` and codes ``clip(rint(x * (1 / s)) + z, 0, 255)``, so
    ``x ~ s * (q - z)`` (all zero where ``s`` is 0), every step in float32, as
    ``csrc/int8_linear.cc`` computes them (the same bits)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    lo = np.minimum(x.min(axis=-1), np.float32(0))
    hi = np.maximum(x.max(axis=-1), np.float32(0))
    scales = (hi - lo) / np.float32(255)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    zeros = np.clip(np.rint(-lo * inverse), 0, 255)
    codes = np.clip(np.rint(x * inverse[..., None]) + zeros[..., None], 0, 255).astype(np.uint8)
    return codes, scales, zeros.astype(np.int32)


def int8_linear_exact(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``x [..., in] @ W^T`` for a weight quantized by :func:`quantize_int8_channels` (``codes
    [out, in]``, ``scales [out]``) with ``x`` quantized by :func:`quantize_uint8_rows`: the integer
    sums exact, then ``(s_x * s_w) * float32(sum(q * c) - z * sum(c))``, as ``csrc/int8_linear.cc``."""
    q, row_scales, zeros = quantize_uint8_rows(x)
    sums = q.astype(np.int64) @ codes.T.astype(np.int64) - zeros[..., None].astype(np.int64) * codes.astype(
        np.int64).sum(axis=1)
    return (row_scales[..., None] * scales) * sums.astype(np.float32)
