"""Linear layers: a weight is prepared once (``prepare``) and applied every step (``__call__``).

``PortableLinear`` keeps the weight as given and calls Paddle's matmul; the C++ variant
(``fd_kernels.native.prepare_linear``) packs float32 weights once into MKL's GEMM layout, so no
step repacks them, and keeps block-quantized weights (``fd_kernels.quantized``) in their blocks. Both
take Paddle-layout weights ``[in, out]``, or ``[out, in]`` with ``transposed=True`` (a head tied to
the embedding), or a :class:`~fd_kernels.quantized.BlockQuantized` ``[out, in]``, and return
``x @ weight (+ bias)``. ``prepare(..., bfloat16=True)`` rounds a float32 weight to bfloat16:
the C++ variant stores it in 16 bits and widens it inside the matmul (half the bytes a decode
step reads), the portable one keeps the rounded values in float32; inputs and sums stay float32,
unless ``bfloat16_inputs=True`` rounds each input to bfloat16 too (the C++ variant then
multiplies on AMX tiles where the CPU has them). ``int8_inputs=True`` quantizes the inputs of a
block-quantized weight to int8 blocks of 32 (``fd_kernels.quantized.quantize_int8_blocks``): the
C++ variant multiplies the blocks in integers, the portable one the quantized values in float32.
``prepare(..., int8=True)`` quantizes a float32 weight per output channel to int8 and each input
per row to uint8 (``fd_kernels.quantized``): the C++ variant multiplies them by MKL's integer GEMM,
the portable one multiplies their values in float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fd_kernels.quantized import (
    BlockQuantized,
    int8_block_values,
    quantize_int8_channels,
    quantize_uint8_rows,
    round_to_bfloat16,
)


def _bfloat16_values(x: paddle.Tensor) -> paddle.Tensor:
    return x.astype(paddle.bfloat16).astype(paddle.float32)   # to nearest even, as round_to_bfloat16


def _int8_values(x: paddle.Tensor) -> paddle.Tensor:
    return paddle.to_tensor(int8_block_values(x.numpy()), place=x.place)


def _uint8_row_values(x: paddle.Tensor) -> paddle.Tensor:
    codes, scales, zeros = quantize_uint8_rows(x.numpy())
    return paddle.to_tensor((codes.astype(np.int32) - zeros[..., None]).astype(np.float32) * scales[..., None],
                            place=x.place)


def _int8_channel_values(weight: np.ndarray) -> np.ndarray:
    """``[out, in]``: the values ``s * c`` of :func:`quantize_int8_channels`' codes."""
    codes, scales = quantize_int8_channels(weight)
    return codes.astype(np.float32) * scales[:, None]


class PortableLinear:
    """``F.linear`` / ``matmul(transpose_y)`` on the weight as given: every device and dtype (a
    block-quantized weight is dequantized to float32 here)."""

    name = "portable"

    def prepare(self, weight: paddle.Tensor, *, transposed: bool = False, bfloat16: bool = False,
                bfloat16_inputs: bool = False, int8_inputs: bool = False, int8: bool = False) -> Any:
        """What :meth:`__call__` takes for ``weight`` (here: the weight itself; with ``bfloat16``, a
        float32 weight rounded to bfloat16 values, still stored as float32, and with
        ``bfloat16_inputs`` each input rounded the same way before the matmul; with ``int8``, a
        float32 weight's int8 channel values, and each input replaced by its uint8 row values; a
        block-quantized weight dequantized, with ``int8_inputs`` each input replaced by its int8
        blocks' values)."""
        if isinstance(weight, BlockQuantized):
            return (paddle.to_tensor(weight.dequantize()), True, _int8_values if int8_inputs else None)
        if int8 and weight.dtype == paddle.float32:
            dense = weight.numpy()
            values = _int8_channel_values(dense if transposed else dense.T)   # [out, in]
            return (paddle.to_tensor(values), True, _uint8_row_values)
        if bfloat16 and weight.dtype == paddle.float32:
            return (paddle.to_tensor(round_to_bfloat16(weight.numpy())), transposed,
                    _bfloat16_values if bfloat16_inputs else None)
        return (weight, transposed, None)

    def __call__(self, x: paddle.Tensor, prepared: Any, bias: paddle.Tensor | None = None) -> paddle.Tensor:
        weight, transposed, round_input = prepared
        if round_input is not None:
            x = round_input(x)
        if transposed:
            out = paddle.matmul(x, weight, transpose_y=True)
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)


PORTABLE_LINEAR = PortableLinear()


def geglu(gate_up: paddle.Tensor) -> paddle.Tensor:
    """``gelu(gate) * up`` (gelu's tanh approximation) of a fused gate/up projection ``[T, 2n]``."""
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return paddle.nn.functional.gelu(gate, approximate=True) * up
