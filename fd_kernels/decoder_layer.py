"""Runs of decoder layers as one kernel call, where the kernels allow it.

A fused layer kernel has ``bind(linears, qkv_bias, qk_norms=None, experts=None, bound_experts=None)``,
called once per layer at load with its four prepared linear weights (qkv, o, gate_up, down; the
last two None in a MoE layer), its q/k norm weights (Qwen3) and a MoE layer's prepared experts
and their ``moe_experts`` binding: it returns that layer's operands, with a ``max_tokens``
attribute, or ``None`` when it cannot run it (a weight the linear kernel left to the portable
path, a bias, experts the ``moe_experts`` kernel did not bind), and the model then runs that layer
op by op. ``join(bindings, norms)``,
also at load, makes one binding of consecutive bound layers (the model's every layer, normally),
which ``__call__`` runs in one call for steps of fewer than its ``max_tokens`` tokens; longer
steps run op by op. ``COMPOSED`` binds nothing: every layer runs op by op. The C++ variant is
``fd_kernels.native.FusedDecoderLayer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ComposedLayer:
    """No fused layer: the model calls the layer's kernels one by one."""

    name = "composed"

    def bind(self, linears: Sequence[Any], qkv_bias: Any, qk_norms: Any = None, experts: Any = None,
             bound_experts: Any = None) -> None:
        """Nothing to bind: ``None`` for every layer."""
        return None


COMPOSED = ComposedLayer()
