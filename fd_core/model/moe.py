"""Mixture-of-experts MLP blocks (Qwen3-MoE, ERNIE 4.5 MoE) over the kernel table's linear and SwiGLU.

A router picks ``top_k`` of ``num_experts`` SwiGLU experts per token from the softmax of its
logits (ERNIE adds a per-expert correction to the scores it ranks by, not to the weights it
mixes with); the chosen weights are optionally renormalised to sum to one. The step's tokens are
grouped by expert, so each expert that got tokens runs its two matrix products once per step over
all of them (not once per token), and its outputs are added back to their tokens' rows scaled
by the routing weight. Shared experts (ERNIE) run on every token and are added. Expert matrices
go through the kernel table's ``linear`` like the dense ones, so every precision mode applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fd_core.model.arch import MoeShape

if TYPE_CHECKING:
    from fd_core.model.kernels import KernelSet


@dataclass(frozen=True, slots=True)
class MoeWeights:
    """One MoE layer, prepared: the router ``[hidden, E]`` (float32), per expert (gate_up, down)
    as the kernel table's linear prepared them, the score correction ``[E]`` or None, and the
    shared experts' (gate_up, down) or None."""

    shape: MoeShape
    router: paddle.Tensor
    experts: tuple[tuple[Any, Any], ...]
    correction: paddle.Tensor | None
    shared: tuple[Any, Any] | None


def prepare_moe(shape: MoeShape, prefix: str, weights: Mapping[str, Any], tensor: Callable[[Any], paddle.Tensor],
                linear: Callable[..., Any]) -> MoeWeights:
    """Prepare the MoE tensors named under ``prefix``; ``tensor`` makes a Paddle tensor, ``linear``
    prepares Hugging Face ``[out, in]`` blocks (concatenated along ``out``) for the linear kernel."""
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
    return MoeWeights(shape, router, experts, correction, shared)


def route(h: paddle.Tensor, moe: MoeWeights) -> tuple[np.ndarray, np.ndarray]:
    """Each token's chosen experts ``[T, k]`` (int64) and their mixing weights ``[T, k]`` (float32)."""
    shape = moe.shape
    probs = F.softmax(paddle.matmul(h.astype("float32"), moe.router), axis=-1)
    scores = probs if moe.correction is None else probs + moe.correction
    _, chosen = paddle.topk(scores, shape.top_k, axis=-1)
    weights = paddle.take_along_axis(probs, chosen, axis=-1)
    if shape.renormalize:
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=shape.norm_min or None)
    return chosen.numpy(), weights.numpy()


def moe_forward(h: paddle.Tensor, moe: MoeWeights, kernels: KernelSet) -> paddle.Tensor:
    """The MoE block's output for ``h [T, hidden]``: the step's (token, choice) pairs grouped by
    expert in one gather, each used expert's products once over its rows (a slice), and one
    scatter of the results scaled by the routing weights: a handful of ops per expert and per layer."""
    linear, swiglu = kernels.linear, kernels.swiglu
    chosen, weights = route(h, moe)
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")   # the pairs, grouped by expert (token order within)
    bounds = np.searchsorted(flat[order], np.arange(moe.shape.num_experts + 1))
    rows = paddle.to_tensor(order // moe.shape.top_k)
    grouped = paddle.gather(h, rows)
    outputs = []
    for expert in np.flatnonzero(np.diff(bounds)):
        gate_up, down = moe.experts[expert]
        outputs.append(linear(swiglu(linear(grouped[int(bounds[expert]):int(bounds[expert + 1])], gate_up)), down))
    scale = paddle.to_tensor(weights.reshape(-1)[order][:, None]).astype(h.dtype)
    out = paddle.scatter_nd_add(paddle.zeros_like(h), rows[:, None], paddle.concat(outputs) * scale)
    if moe.shared is not None:
        gate_up, down = moe.shared
        out = out + linear(swiglu(linear(h, gate_up)), down)
    return out
