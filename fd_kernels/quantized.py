"""Weights kept in blocks of 32 low-bit codes (GGUF's Q4_0, Q4_1, Q8_0 and K-quants), as the matmul reads them.

A :class:`BlockQuantized` is a ``[rows, cols]`` matrix (rows = output features, HF's ``[out, in]``)
whose row ``j`` is stored in blocks of 32 values along ``cols``: value ``32 b + i`` is
``scales[j, g] * q_i + mins[j, b]``, with ``g`` its group of ``group`` values (32, or 16 where a
block has two scales, as Q6_K's do). 4-bit codes pack two values a byte (the low nibbles of a
block's 16 bytes are values 0-15, the high nibbles 16-31, GGUF's Q4_0 order); 8-bit codes are int8.
Scales and mins are float32, so :meth:`dequantize` equals GGUF's dequantization bit for bit
(a half-precision scale times a small integer is exact in float32, and the one rounding left is
that of ``scale * q + min``, as in gguf-py).

GGUF's K-quants become such blocks at load (:func:`from_gguf_blocks`): a Q4_K super-block of 256
is eight blocks of 4-bit codes whose scale and min are its ``d * sc`` and ``-dmin * m``; Q5_K's
5-bit codes are stored in 8 bits; Q6_K's are stored as int8 ``q - 32`` with a scale per 16.

:func:`round_to_bfloat16` gives the values a bfloat16 weight (``linear_weights = "bfloat16"``) holds;
:func:`quantize_int8_blocks` the int8 blocks an input becomes with ``linear_inputs = "int8"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np

BLOCK: Final = 32


@dataclass(frozen=True, slots=True)
class BlockQuantized:
    """A ``[rows, cols]`` matrix in 4- or 8-bit blocks of 32 along ``cols`` (see the module docstring)."""

    bits: int             # 4 or 8
    codes: np.ndarray     # uint8 [rows, cols * bits / 8]
    scales: np.ndarray    # float32 [rows, cols / group]
    mins: np.ndarray      # float32 [rows, cols / 32]

    def __post_init__(self) -> None:
        rows, blocks = self.mins.shape
        if (self.bits not in (4, 8) or self.codes.dtype != np.uint8
                or self.codes.shape != (rows, blocks * self.bits * 4)):
            raise ValueError(f"codes {self.codes.dtype}{list(self.codes.shape)} do not hold {rows} rows of "
                             f"{blocks} {self.bits}-bit blocks")
        if self.scales.shape not in ((rows, blocks), (rows, 2 * blocks)):
            raise ValueError(f"scales {list(self.scales.shape)} are not one or two per block of mins "
                             f"{list(self.mins.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix it stands for."""
        return self.mins.shape[0], self.mins.shape[1] * BLOCK

    @property
    def group(self) -> int:
        """Values per scale: 32, or 16 (two scales a block)."""
        return self.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and mins)."""
        return self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    @classmethod
    def from_int_codes(cls, bits: int, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> BlockQuantized:
        """The matrix of integer ``codes [rows, cols]`` (0..15 for 4 bits, -128..127 for 8)."""
        if bits == 8:
            packed = np.ascontiguousarray(codes, dtype=np.int8).view(np.uint8)
        else:
            halves = np.asarray(codes, dtype=np.uint8).reshape(codes.shape[0], -1, 2, BLOCK // 2)
            packed = (halves[:, :, 0] | (halves[:, :, 1] << np.uint8(4))).reshape(codes.shape[0], -1)
        return cls(bits, np.ascontiguousarray(packed), np.ascontiguousarray(scales, dtype=np.float32),
                   np.ascontiguousarray(mins, dtype=np.float32))

    def int_codes(self) -> np.ndarray:
        """The codes as integers ``[rows, cols]`` (0..15 for 4 bits, -128..127 for 8)."""
        if self.bits == 8:
            return self.codes.view(np.int8)
        rows, blocks = self.mins.shape
        packed = self.codes.reshape(rows, blocks, 1, BLOCK // 2)
        nibbles = (packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        return nibbles.reshape(rows, blocks * BLOCK)

    def dequantize(self) -> np.ndarray:
        """The float32 matrix ``[rows, cols]``."""
        rows, cols = self.shape
        q = self.int_codes().reshape(rows, -1, self.group).astype(np.float32)
        products = (q * self.scales[..., None]).reshape(rows, -1, BLOCK)
        return (products + self.mins[..., None]).reshape(rows, cols)

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

    def halved(self) -> BlockQuantized:
        """The same values with a scale per 16 (each scale of a group of 32 twice)."""
        if self.group == 16:
            return self
        return BlockQuantized(self.bits, self.codes, np.repeat(self.scales, 2, axis=1), self.mins)


def stack_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """One matrix of ``parts``' rows in order (a fused q/k/v or gate/up weight); mixed widths are
    widened to 8 bits, mixed groups halved to 16."""
    if len({part.bits for part in parts}) > 1:
        parts = [part.widened() for part in parts]
    if len({part.group for part in parts}) > 1:
        parts = [part.halved() for part in parts]
    return BlockQuantized(parts[0].bits, *(np.concatenate([getattr(p, field) for p in parts])
                                           for field in ("codes", "scales", "mins")))


#: GGUF types :func:`from_gguf_blocks` keeps in blocks: values per GGUF block and bytes per block.
GGUF_BLOCK_TYPES: Final = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
                           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def from_gguf_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> BlockQuantized:
    """A ``[rows, cols]`` matrix from a GGUF tensor's raw bytes (``kind`` one of :data:`GGUF_BLOCK_TYPES`)."""
    rows, cols = shape
    if kind not in GGUF_BLOCK_TYPES or cols % GGUF_BLOCK_TYPES[kind][0]:
        raise ValueError(f"cannot keep a {kind} tensor of shape {list(shape)} in blocks of {BLOCK}")
    values, size = GGUF_BLOCK_TYPES[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // values, -1)
    if blocks.shape[-1] != size:
        raise ValueError(f"{kind} blocks of {blocks.shape[-1]} bytes, expected {size}")
    return _GGUF_DECODERS[kind](blocks.reshape(rows * (cols // values), size), rows)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Codes of K-quant bytes ``[n, 32 c]``: per 32 bytes, the low nibbles are one block of 32
    values, the high nibbles the next (``[n, 64 c]``)."""
    chunks = packed.reshape(len(packed), -1, 1, 32)
    return ((chunks >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)).reshape(len(packed), -1)


def _legacy(kind: str) -> Callable[[np.ndarray, int], BlockQuantized]:
    """Q4_0 / Q4_1 / Q8_0: a half-precision scale (and Q4_1's min) before each block's codes."""
    has_min = kind == "Q4_1"

    def decode(blocks: np.ndarray, rows: int) -> BlockQuantized:
        scales = _half(blocks, 0)
        if has_min:
            mins = _half(blocks, 2)
        elif kind == "Q4_0":   # d * (q - 8) = d * q - 8 d, exact
            mins = scales * np.float32(-8)
        else:
            mins = np.zeros_like(scales)
        bits = 8 if kind == "Q8_0" else 4
        codes = np.ascontiguousarray(blocks[:, 4 if has_min else 2:]).reshape(rows, -1)
        return BlockQuantized(bits, codes, scales.reshape(rows, -1), mins.reshape(rows, -1))

    return decode


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit scales and mins per super-block from its 12 bytes, as float32."""
    d, m, m_d = (packed[:, i * 4:(i + 1) * 4] for i in range(3))
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k_or_q5_k(high_bits: bool) -> Callable[[np.ndarray, int], BlockQuantized]:
    """Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits),
    128 bytes of 4-bit codes; value ``d * sc * q - dmin * m`` per block of 32."""

    def decode(blocks: np.ndarray, rows: int) -> BlockQuantized:
        sc, m = _k_scales(blocks[:, 4:16])
        codes = _nibbles(blocks[:, -128:])
        if high_bits:   # bit b of byte i is the fifth bit of value i of block b
            fifth = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)
            codes = codes | (fifth.transpose(0, 2, 1).reshape(len(blocks), -1) << np.uint8(4))
        scales, mins = _half(blocks, 0) * sc, -(_half(blocks, 2) * m)
        return BlockQuantized.from_int_codes(8 if high_bits else 4, codes.reshape(rows, -1),
                                             scales.reshape(rows, -1), mins.reshape(rows, -1))

    return decode


def _q6_k(blocks: np.ndarray, rows: int) -> BlockQuantized:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; value
    ``d * sc * (q - 32)`` per 16, kept as int8 ``q - 32`` with a scale per 16."""
    low = blocks[:, :128].reshape(len(blocks), -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(len(blocks), -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1)
    codes = ((low & np.uint8(0x0F)).reshape(len(blocks), -1, 32)
             | ((high & np.uint8(0x03)).reshape(len(blocks), -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = _half(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return BlockQuantized.from_int_codes(8, codes.reshape(rows, -1), scales.reshape(rows, -1),
                                         np.zeros((rows, codes.size // rows // BLOCK), np.float32))


_GGUF_DECODERS: Final[dict[str, Callable[[np.ndarray, int], BlockQuantized]]] = {
    "Q4_0": _legacy("Q4_0"), "Q4_1": _legacy("Q4_1"), "Q8_0": _legacy("Q8_0"),
    "Q4_K": _q4_k_or_q5_k(high_bits=False), "Q5_K": _q4_k_or_q5_k(high_bits=True), "Q6_K": _q6_k,
}


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
