"""Contract of the Platform seam: device detection, memory profile and worker set-up.

Call order at start-up: the registry loads every platform class (import only), the engine calls
:meth:`Platform.detect` on each (or only on the one named by ``platform.name``), picks the
available platform with the highest :attr:`Platform.priority`, instantiates it with its
validated settings, then calls :meth:`Platform.worker_env`, :meth:`Platform.prepare_process`,
:meth:`Platform.device_string`
and :meth:`Platform.kv_cache_memory_bytes` before any model weights are loaded, and picks every
swappable kernel from the instance's :attr:`Platform.capabilities`
(``fd_core.model.kernels.select_kernels``).

Invariants:
- :meth:`detect` never raises and never initialises a device context; it answers from
  compile flags, libraries and environment only.
- :meth:`kv_cache_memory_bytes` is a byte budget for K and V tensors only, after the
  model weights and an activation reserve are taken out.
- :attr:`capabilities` lists only what is safe to use on this machine with these settings: a
  kernel is picked when every capability it requires is declared, so declaring too much can
  crash the engine (an illegal instruction), declaring too little only costs speed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

#: Capability: the platform runs the paged KV cache kernels (every built-in does).
PAGED_ATTENTION: Final = "paged_attention"
#: Capability: the device has float16 kernels.
FLOAT16: Final = "float16"
#: Capability: Paddle's ``fused_rms_norm`` op is safe on this device (its CPU kernel needs AVX-512F).
FUSED_RMS_NORM: Final = "fused_rms_norm"
#: Capability: fd-engine's C++ host kernels (``fd_kernels/csrc``) may run on this device's tensors,
#: built for the ISA features the platform also declares (``avx2``, ``fma``, ``avx512f``).
CPP_KERNELS: Final = "cpp_kernels"
#: Capability: bfloat16 pair dot products (``vdpbf16ps``) outrun float32 FMA on this CPU, so the C++
#: kernels multiply operands already rounded to bfloat16 with them (needs ``avx512_bf16`` too).
BF16_DOT_PRODUCTS: Final = "bf16_dot_products"


@dataclass(frozen=True, slots=True)
class DetectResult:
    """What :meth:`Platform.detect` found."""

    available: bool
    reason: str  # why (not) available, shown by ``fd-serve plugins list`` and in errors
    device_count: int = 0


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """Device memory in bytes, as read by :meth:`Platform.memory_profile`."""

    total_bytes: int
    free_bytes: int


class Platform(SeamPlugin, ABC):
    """A hardware target the model runner can execute on."""

    #: Higher wins when several platforms are available and ``platform.name = "auto"``.
    priority: ClassVar[int] = 0
    #: Optional abilities declared by this platform *instance*, e.g. ``{"paged_attention",
    #: "fused_rms_norm", "avx2"}``; read after construction, so a platform whose abilities depend
    #: on the machine or its settings (cpu) sets it in ``__init__``. The names the core reads are
    #: the constants of this module; a platform may declare more for its own kernels.
    capabilities: frozenset[str] = frozenset()

    def __init__(self, settings: BaseModel | None = None) -> None:
        self.settings = settings

    @classmethod
    @abstractmethod
    def detect(cls) -> DetectResult:
        """Report whether this platform can run here. Must never raise."""

    @abstractmethod
    def device_string(self, local_rank: int = 0) -> str:
        """Paddle device string for a worker, e.g. ``"cpu"`` or ``"gpu:0"``."""

    @abstractmethod
    def supported_dtypes(self) -> tuple[str, ...]:
        """Model dtypes this platform can run, most preferred first (e.g. ``("float32",)``)."""

    def num_threads(self) -> int | None:
        """Host math threads the runner should use; ``None`` lets it use every usable CPU."""
        return None

    def worker_env(self) -> dict[str, str]:
        """Environment variables a worker process needs before importing Paddle."""
        return {}

    def prepare_process(self) -> str:
        """Tune the engine's own process once, before the model loads (e.g. its host allocator);
        returns what was done, for the start-up log ("" when nothing)."""
        return ""

    @abstractmethod
    def memory_profile(self) -> MemoryProfile:
        """Total and free device memory in bytes."""

    def kv_cache_memory_bytes(self, *, utilization: float, weights_bytes: int,
                              activation_reserve_bytes: int) -> int:
        """Bytes available for the KV cache given the share of memory the engine may use.

        The default takes ``utilization`` of total memory, subtracts weights and the activation
        reserve, and never promises more than is free now.
        """
        profile = self.memory_profile()
        budget = int(profile.total_bytes * utilization) - weights_bytes - activation_reserve_bytes
        return max(0, min(budget, profile.free_bytes - activation_reserve_bytes))
