"""Mixture-of-experts MLP blocks (Qwen3-MoE, ERNIE 4.5 MoE) over the kernel table's ``moe_experts``.

A router picks ``top_k`` of ``num_experts`` SwiGLU experts per token from the softmax of its
logits (ERNIE adds a per-expert correction to the scores it ranks by, not to the weights it
mixes with); the chosen weights are optionally renormalised to sum to one. The kernel table's
``moe_experts`` groups the step's tokens by expert, so each expert that got tokens runs its two
matrix products once per step over all of them (not once per token), and adds its outputs back
to their tokens' rows scaled by the routing weight (``fd_kernels.moe``; in one C++ op where the
kernels allow). Shared experts (ERNIE) run on every token and are added. Expert matrices are
prepared by the kernel table's linear like the dense ones, so every precision mode applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle

from fd_core.model.arch import MoeShape
from fd_kernels.moe import Router

if TYPE_CHECKING:
    from fd_core.model.kernels import KernelSet


@dataclass(frozen=True, slots=True)
class MoeWeights:
    """One MoE layer, prepared: per expert (gate_up, down) as the kernel table's linear prepared
    them, the shared experts' (gate_up, down) or None, and ``bound``: the router and the experts as
    the kernel table's ``moe_experts`` bound them."""

    shape: MoeShape
    experts: tuple[tuple[Any, Any], ...]
    shared: tuple[Any, Any] | None
    bound: Any


def prepare_moe(shape: MoeShape, prefix: str, weights: Mapping[str, Any], tensor: Callable[[Any], paddle.Tensor],
                linear: Callable[..., Any], bind: Callable[..., Any]) -> MoeWeights:
    """Prepare the MoE tensors named under ``prefix``; ``tensor`` makes a Paddle tensor, ``linear``
    prepares Hugging Face ``[out, in]`` blocks (concatenated along ``out``) for the linear kernel,
    ``bind`` is the ``moe_experts`` kernel's."""
    router = paddle.to_tensor(np.ascontiguousarray(np.asarray(weights[f"{prefix}gate.weight"], np.float32).T))
    expert = f"{prefix}experts."
    experts = tuple((linear(weights[f"{expert}{e}.gate_proj.weight"], weights[f"{expert}{e}.up_proj.weight"]),
                     linear(weights[f"{expert}{e}.down_proj.weight"]))
                    for e in range(shape.num_experts))
    correction = (paddle.to_tensor(np.asarray(weights[f"{prefix}moe_statics.e_score_correction_bias"],
                                              np.float32).reshape(-1))
                  if shape.score_correction else None)
    shared = ((linear(weights[f"{prefix}shared_experts.gate_proj.weight"],
                      weights[f"{prefix}shared_experts.up_proj.weight"]),
               linear(weights[f"{prefix}shared_experts.down_proj.weight"]))
              if shape.shared_intermediate_size else None)
    bound = bind(Router(router, correction, shape.top_k, shape.renormalize, shape.norm_min), experts)
    return MoeWeights(shape, experts, shared, bound)


def moe_forward(h: paddle.Tensor, moe: MoeWeights, kernels: KernelSet) -> paddle.Tensor:
    """The MoE block's output for ``h [T, hidden]``: the routed experts' (``moe_experts``), plus the
    shared experts'."""
    linear, swiglu = kernels.linear, kernels.swiglu
    out = kernels.moe_experts(h, moe.bound, linear, swiglu)
    if moe.shared is not None:
        gate_up, down = moe.shared
        out = out + linear(swiglu(linear(h, gate_up)), down)
    return out
