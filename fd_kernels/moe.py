"""A mixture-of-experts layer's routed experts over a step's tokens, each used expert once per step.

The ``moe_experts`` kernel (``fd_core.model.kernels``) has ``bind(router, experts)``, called once
per MoE layer at load with its :class:`Router` and per expert its (gate_up, down) as the kernel
table's linear prepared them; what it returns is the layer's ``bound`` operand of
``__call__(h, bound, linear, swiglu) -> [T, hidden]``: the sum over each token's chosen experts of
routing weight x ``down(swiglu(gate_up(h)))``, contributions added in ascending expert order.

:data:`GROUPED` is the portable variant, in Paddle: :func:`route`, then :func:`grouped_experts`
through the given ``linear`` and ``swiglu`` kernels. The C++ variant
(``fd_kernels.native.FusedExperts``, ``csrc/moe_experts.cc``) does both in one op, routing each
token alone (the same definition, in other bits: see there) and calling the same linear kernels
with the same arguments, so given the same routing the two give the same bits. It binds layers
whose expert linears the C++ linear kernel prepared, and runs the others as :data:`GROUPED` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F


@dataclass(frozen=True, slots=True)
class Router:
    """How a MoE layer's tokens pick their experts (see :func:`route`)."""

    weight: paddle.Tensor              # [hidden, E] float32: a token's logits are h @ weight
    correction: paddle.Tensor | None   # [E] float32 added to the scores experts are ranked by (ERNIE), or None
    top_k: int                         # experts a token
    renormalize: bool                  # the chosen weights are divided by their sum ...
    norm_min: float                    # ... clamped below at this (0: not clamped)


@dataclass(frozen=True, slots=True)
class BoundExperts:
    """A MoE layer as :data:`GROUPED` runs it: its router, per expert its prepared (gate_up, down)."""

    router: Router
    experts: tuple[tuple[Any, Any], ...]


def route(h: paddle.Tensor, router: Router) -> tuple[np.ndarray, np.ndarray]:
    """Each token's chosen experts ``[T, k]`` (int64, highest score first) and their mixing weights
    ``[T, k]`` (float32): the top ``k`` of softmax(h @ weight) + correction, weighted by the
    softmax, renormalised when the router says so."""
    probs = F.softmax(paddle.matmul(h.astype("float32"), router.weight), axis=-1)
    scores = probs if router.correction is None else probs + router.correction
    _, chosen = paddle.topk(scores, router.top_k, axis=-1)
    weights = paddle.take_along_axis(probs, chosen, axis=-1)
    if router.renormalize:
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=router.norm_min or None)
    return chosen.numpy(), weights.numpy()


def grouped_experts(h: paddle.Tensor, chosen: np.ndarray, weights: np.ndarray, experts: Sequence[tuple[Any, Any]],
                    linear: Any, swiglu: Callable[[paddle.Tensor], paddle.Tensor]) -> paddle.Tensor:
    """The routed experts' output for ``h [T, hidden]`` routed as ``chosen`` and ``weights``
    (:func:`route`'s): the step's (token, choice) pairs grouped by expert in one gather (tokens
    ascending within an expert), each used expert's products once over its rows (a slice), and one
    scatter of the results scaled by the routing weights, which adds a token's contributions in
    ascending expert order: a handful of ops per expert and per layer."""
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")   # the pairs, grouped by expert (token order within)
    bounds = np.searchsorted(flat[order], np.arange(len(experts) + 1))
    rows = paddle.to_tensor(order // chosen.shape[1])
    grouped = paddle.gather(h, rows)
    outputs = []
    for expert in np.flatnonzero(np.diff(bounds)):
        gate_up, down = experts[expert]
        outputs.append(linear(swiglu(linear(grouped[int(bounds[expert]):int(bounds[expert + 1])], gate_up)), down))
    scale = paddle.to_tensor(weights.reshape(-1)[order][:, None]).astype(h.dtype)
    return paddle.scatter_nd_add(paddle.zeros_like(h), rows[:, None], paddle.concat(outputs) * scale)


class GroupedExperts:
    """The portable ``moe_experts``: Paddle's routing, then :func:`grouped_experts`."""

    def bind(self, router: Router, experts: Sequence[tuple[Any, Any]]) -> BoundExperts:
        """The layer as :meth:`__call__` takes it (see the module docstring)."""
        return BoundExperts(router, tuple(experts))

    def __call__(self, h: paddle.Tensor, bound: BoundExperts, linear: Any,
                 swiglu: Callable[[paddle.Tensor], paddle.Tensor]) -> paddle.Tensor:
        chosen, weights = route(h, bound.router)
        return grouped_experts(h, chosen, weights, bound.experts, linear, swiglu)


GROUPED = GroupedExperts()
