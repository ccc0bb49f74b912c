"""RMSNorm with a fused residual add: Paddle's fused op and a portable one of plain Paddle ops.

Both compute, for ``x`` and an optional ``residual`` of shape ``[tokens, hidden]``::

    s = x + residual            (s = x when residual is None)
    out = s / sqrt(mean(s * s, axis=-1) + eps) * weight

and return ``(out, s)``: the normed input of the next block and the new residual stream.
Which one runs is the model runner's choice from the platform's declared capabilities
(``fd_core.model.kernels``); model code never calls either directly.
"""

from __future__ import annotations

import paddle
from paddle.incubate.nn.functional import fused_rms_norm


def rms_norm_portable(x: paddle.Tensor, weight: paddle.Tensor, eps: float,
                      residual: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Plain Paddle ops: runs on every device and CPU Paddle runs on."""
    s = x if residual is None else x + residual
    variance = (s * s).mean(axis=-1, keepdim=True)
    return s * paddle.rsqrt(variance + eps) * weight, s


def rms_norm_fused(x: paddle.Tensor, weight: paddle.Tensor, eps: float,
                   residual: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Paddle's ``fused_rms_norm`` (one kernel; on CPU it executes AVX-512 instructions)."""
    if residual is None:
        return fused_rms_norm(x, weight, None, eps, 1)[0], x
    out, residual_out = fused_rms_norm(x, weight, None, eps, 1, residual=residual)[:2]
    return out, residual_out
