"""Pick the implementation of every swappable op from a platform's declared capabilities.

This table is the one place where a kernel's requirements are written down. Each op lists its
variants, most preferred first; a variant is usable when the platform declares every
capability it requires, and each op's last variant requires nothing (the portable fallback), so
selection always succeeds. Model code receives the chosen functions in a :class:`KernelSet`
and never checks devices or catches kernel errors itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Final

from fd_core.contracts.platform import FUSED_RMS_NORM
from fd_kernels import rms_norm


@dataclass(frozen=True, slots=True)
class KernelVariant:
    """One implementation of an op."""

    name: str                    # shown in the start-up line, e.g. "fused"
    requires: frozenset[str]     # capabilities the platform must declare
    fn: Callable[..., Any]


#: op -> variants, most preferred first; the last one of each requires nothing.
KERNEL_VARIANTS: Final[dict[str, tuple[KernelVariant, ...]]] = {
    "rms_norm": (
        KernelVariant("fused", frozenset({FUSED_RMS_NORM}), rms_norm.rms_norm_fused),
        KernelVariant("portable", frozenset(), rms_norm.rms_norm_portable),
    ),
}


@dataclass(frozen=True, slots=True)
class KernelSet:
    """The chosen variant of every op in :data:`KERNEL_VARIANTS`."""

    chosen: dict[str, KernelVariant]

    @property
    def rms_norm(self) -> Callable[..., Any]:
        """``(x, weight, eps, residual) -> (normed, residual stream)``; see ``fd_kernels.rms_norm``."""
        return self.chosen["rms_norm"].fn

    def describe(self) -> str:
        """``rms_norm=portable (fused needs fused_rms_norm)``: each choice, and why not better."""
        parts = []
        for op, variant in self.chosen.items():
            better = KERNEL_VARIANTS[op][: KERNEL_VARIANTS[op].index(variant)]
            why = ", ".join(f"{v.name} needs {' '.join(sorted(v.requires))}" for v in better)
            parts.append(f"{op}={variant.name}" + (f" ({why})" if why else ""))
        return "; ".join(parts)


def select_kernels(capabilities: Collection[str]) -> KernelSet:
    """The most preferred variant of each op whose requirements ``capabilities`` meet."""
    declared = frozenset(capabilities)
    return KernelSet({op: next(v for v in variants if v.requires <= declared)
                      for op, variants in KERNEL_VARIANTS.items()})


#: Every op's fallback: what a model built without a platform uses.
PORTABLE_KERNELS: Final = select_kernels(())
