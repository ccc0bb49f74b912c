"""Pick the implementation of every swappable op from a platform's declared capabilities.

This table is the one place where a kernel's requirements are written down. Each op lists its
variants, most preferred first; a variant is usable when the platform declares every
capability it requires (and, for a variant with a ``prepare`` step such as building the C++
kernels, when that step succeeds: else the next variant is used and the reason is shown), and
each op's last variant requires nothing (the portable fallback), so selection always succeeds.
Model code receives the chosen functions in a :class:`KernelSet` and never checks devices or
catches kernel errors itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Final

import paddle.nn.functional as F

from fd_core.contracts.platform import CPP_KERNELS, FUSED_RMS_NORM
from fd_kernels import decoder_layer, linear, moe, native, paged_attention, rms_norm


@dataclass(frozen=True, slots=True)
class KernelVariant:
    """One implementation of an op: ``fn``, or what ``prepare(capabilities)`` returns (it raises
    :class:`~fd_kernels.native.NativeKernelsUnavailable` saying why it cannot be used here)."""

    name: str                    # shown in the start-up line, e.g. "fused"
    requires: frozenset[str]     # capabilities the platform must declare
    fn: Callable[..., Any] | None
    prepare: Callable[[frozenset[str]], Callable[..., Any]] | None = None


#: op -> variants, most preferred first; the last one of each requires nothing.
KERNEL_VARIANTS: Final[dict[str, tuple[KernelVariant, ...]]] = {
    "rms_norm": (
        KernelVariant("cpp", frozenset({CPP_KERNELS}), None, native.prepare_rms_norm),
        KernelVariant("fused", frozenset({FUSED_RMS_NORM}), rms_norm.rms_norm_fused),
        KernelVariant("portable", frozenset(), rms_norm.rms_norm_portable),
    ),
    "rope_write_kv": (
        KernelVariant("cpp", frozenset({CPP_KERNELS}), None, native.prepare_rope_write_kv),
        KernelVariant("reference", frozenset(), paged_attention.rope_write_kv_reference),
    ),
    "linear": (
        KernelVariant("mkl_packed", frozenset({CPP_KERNELS}), None, native.prepare_linear),
        KernelVariant("portable", frozenset(), linear.PORTABLE_LINEAR),
    ),
    "swiglu": (
        KernelVariant("cpp", frozenset({CPP_KERNELS}), None, native.prepare_swiglu),
        KernelVariant("portable", frozenset(), F.swiglu),
    ),
    "geglu": (
        KernelVariant("portable", frozenset(), linear.geglu),
    ),
    "attention": (
        KernelVariant("cpp", frozenset({CPP_KERNELS}), None, native.prepare_attention),
        KernelVariant("reference", frozenset(), paged_attention.attention_reference),
    ),
    "decoder_layer": (
        KernelVariant("cpp", frozenset({CPP_KERNELS}), None, native.prepare_decoder_layer),
        KernelVariant("composed", frozenset(), decoder_layer.COMPOSED),
    ),
    "moe_experts": (
        KernelVariant("cpp", frozenset({CPP_KERNELS}), None, native.prepare_moe_experts),
        KernelVariant("grouped", frozenset(), moe.GROUPED),
    ),
}


@dataclass(frozen=True, slots=True)
class KernelSet:
    """The chosen variant of every op in :data:`KERNEL_VARIANTS` (``fn`` set), and why better
    variants were passed over."""

    chosen: dict[str, KernelVariant]
    passed_over: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def rms_norm(self) -> Callable[..., Any]:
        """``(x, weight, eps, residual) -> (normed, residual stream)``; see ``fd_kernels.rms_norm``."""
        return self.chosen["rms_norm"].fn

    @property
    def rope_write_kv(self) -> Callable[..., Any]:
        """``(cos, sin, attn, num_heads) -> layer(qkv, k_cache, v_cache) -> q``, once per step; see
        ``fd_kernels.paged_attention.rope_write_kv_reference``."""
        return self.chosen["rope_write_kv"].fn

    @property
    def linear(self) -> Any:
        """``.prepare(weight, transposed=False)`` once per weight, then ``(x, prepared, bias=None) ->
        x @ weight``; see ``fd_kernels.linear``."""
        return self.chosen["linear"].fn

    @property
    def swiglu(self) -> Callable[..., Any]:
        """``(gate_up [T, 2n]) -> silu(gate) * up [T, n]``: the MLP's activation."""
        return self.chosen["swiglu"].fn

    @property
    def geglu(self) -> Callable[..., Any]:
        """``(gate_up [T, 2n]) -> gelu_tanh(gate) * up [T, n]``: Gemma's MLP activation."""
        return self.chosen["geglu"].fn

    @property
    def attention(self) -> Callable[..., Any]:
        """``(q, k_cache, v_cache, attn, round_queries=False, window=None) -> out``: every row of a step, q
        already scaled; with ``window`` a query at p sees keys p - window + 1 .. p; see ``fd_kernels``."""
        return self.chosen["attention"].fn

    @property
    def decoder_layer(self) -> Any:
        """``.bind(linears, qkv_bias)`` once per layer and ``.join(bindings, norms)`` once per run of
        bound layers, then ``(run, x, residual, k_caches, v_caches, attn, cos, sin, num_heads, head_dim,
        eps) -> (out, residual)``: the run's layers in one call, for steps of fewer than its
        ``.max_tokens`` tokens; see ``fd_kernels.decoder_layer``."""
        return self.chosen["decoder_layer"].fn

    @property
    def moe_experts(self) -> Any:
        """``.bind(router, experts)`` once per MoE layer, then ``(h, bound, linear, swiglu) -> out``: the
        layer's routed experts over a step's tokens, each used expert's products once; see ``fd_kernels.moe``."""
        return self.chosen["moe_experts"].fn

    @property
    def reads_gather_inputs(self) -> bool:
        """Whether a reference kernel runs, which reads the step's gather indices, masks and write index
        (the C++ kernels read block tables and slots only)."""
        return (self.chosen["attention"].fn is paged_attention.attention_reference
                or self.chosen["rope_write_kv"].fn is paged_attention.rope_write_kv_reference)

    def describe(self) -> str:
        """``rms_norm=portable (fused needs fused_rms_norm)``: each choice, and why not better."""
        parts = []
        for op, variant in self.chosen.items():
            why = ", ".join(self.passed_over.get(op, []))
            parts.append(f"{op}={variant.name}" + (f" ({why})" if why else ""))
        return "; ".join(parts)


def select_kernels(capabilities: Collection[str]) -> KernelSet:
    """The most preferred usable variant of each op (see the module docstring)."""
    declared = frozenset(capabilities)
    chosen: dict[str, KernelVariant] = {}
    passed_over: dict[str, list[str]] = {}
    for op, variants in KERNEL_VARIANTS.items():
        for variant in variants:
            if not variant.requires <= declared:
                passed_over.setdefault(op, []).append(f"{variant.name} needs {' '.join(sorted(variant.requires))}")
                continue
            if variant.prepare is not None:
                try:
                    variant = dataclasses.replace(variant, fn=variant.prepare(declared))
                except native.NativeKernelsUnavailable as exc:
                    passed_over.setdefault(op, []).append(f"{variant.name}: {exc}")
                    continue
            chosen[op] = variant
            break
    return KernelSet(chosen, passed_over)


#: Every op's fallback: what a model built without a platform uses.
PORTABLE_KERNELS: Final = select_kernels(())
