"""The CPU platform: runs everywhere Paddle runs, with host memory as the KV cache pool."""

from __future__ import annotations

import os
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.platform import (
    BF16_DOT_PRODUCTS,
    CPP_KERNELS,
    FUSED_RMS_NORM,
    PAGED_ATTENTION,
    DetectResult,
    MemoryProfile,
    Platform,
)
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.platforms import cpu_features, host_tuning

#: Environment variables that size the thread pools of OpenMP, MKL and OpenBLAS.
_THREAD_VARS: Final = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: MKL's code-path override, and the value of its AVX2 path (see CpuPlatform.worker_env).
MKL_CPU_TYPE_VAR: Final = "MKL_DEBUG_CPU_TYPE"
MKL_AVX2_CPU_TYPE: Final = "5"


class CpuSettings(BaseModel):
    """``[platform.options]`` of the cpu platform."""

    model_config = ConfigDict(extra="forbid")

    num_threads: int | None = Field(
        None, ge=1, description="Math threads per worker (Paddle, OpenMP, MKL); None: every usable CPU.")
    keep_freed_memory: bool = Field(
        True, description="Tune glibc's malloc in the engine process to keep freed memory for reuse instead of "
                          "unmapping it (a step's buffers are then not faulted in anew every step; resident "
                          "memory settles at the largest step's). Off: the allocator's defaults.")
    kernels: Literal["auto", "portable"] = Field(
        "auto", description="'auto': kernels chosen by the CPU's features; 'portable': plain Paddle "
                            "ops only, on any CPU (declares no ISA capability).")


def read_meminfo(path: str = "/proc/meminfo") -> MemoryProfile:
    """Host MemTotal and MemAvailable (Linux ``/proc/meminfo``, kB) in bytes."""
    fields: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return MemoryProfile(total_bytes=fields["MemTotal"], free_bytes=fields["MemAvailable"])


def cpu_capabilities(features: cpu_features.CpuFeatures, kernels: str) -> frozenset[str]:
    """What the cpu platform declares: its ISA features, and the kernels they make safe.

    Paddle's CPU ``fused_rms_norm`` runs AVX-512 code without checking the CPU (SIGILL on
    AVX2-only machines), so it is declared only where ``avx512f`` is present. fd-engine's C++
    kernels (built for exactly the declared ISA features) run on host tensors on every CPU;
    ``kernels = "portable"`` declares neither (plain Paddle ops only). ``bf16_dot_products`` is
    declared for an AMD CPU with ``avx512_bf16`` (Zen 4 and later: ``vdpbf16ps`` measured ~1.7x
    float32 FMA's rate on a Zen 4 core) and not for Intel's (half the rate on an Emerald Rapids
    core; where Intel has AMX, its tiles multiply bfloat16 instead).
    """
    if kernels == "portable":
        return frozenset({PAGED_ATTENTION})
    declared = {PAGED_ATTENTION, CPP_KERNELS, *features.present}
    if "avx512f" in features.present:
        declared.add(FUSED_RMS_NORM)
    if "avx512_bf16" in features.present and features.vendor == "AuthenticAMD":
        declared.add(BF16_DOT_PRODUCTS)
    return frozenset(declared)


class CpuPlatform(Platform):
    """Float32 execution on the host CPU; the fallback when no accelerator is found.

    Capabilities follow the CPU it runs on (:func:`cpu_capabilities`), probed once per instance.
    """

    name: ClassVar[str] = "cpu"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel] | None] = CpuSettings
    priority: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass (a CPU-based platform plugin) keeps :class:`CpuSettings`' keys, which every
        method here reads: its settings model must subclass it (refused at import otherwise)."""
        super().__init_subclass__(**kwargs)
        model = cls.__dict__.get("settings_model")
        if model is not None and not issubclass(model, CpuSettings):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.settings_model must subclass CpuSettings "
                            "(CpuPlatform reads its num_threads and kernels)")

    def __init__(self, settings: BaseModel | None = None) -> None:
        super().__init__(settings if settings is not None else CpuSettings())
        if not isinstance(self.settings, CpuSettings):
            raise TypeError(f"{type(self).__name__} needs CpuSettings (or a subclass), "
                            f"got {type(self.settings).__name__}")
        self.features = cpu_features.probe_cpu_features()
        self.capabilities = cpu_capabilities(self.features, self.settings.kernels)

    @classmethod
    def detect(cls) -> DetectResult:
        """Always available; the reason names the CPU model, its features and usable cores."""
        features = cpu_features.probe_cpu_features()
        return DetectResult(True, f"host CPU {features.describe()} "
                                  f"({len(os.sched_getaffinity(0))} usable cores)", 1)

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        # Paddle's CPU kernels cover float32 fully; bfloat16/float16 matmuls are slow or missing.
        return ("float32",)

    def num_threads(self) -> int:
        """``num_threads`` or every CPU this process may run on."""
        return self.settings.num_threads or len(os.sched_getaffinity(0))

    def worker_env(self) -> dict[str, str]:
        """Thread counts for OpenMP/MKL/OpenBLAS (:meth:`num_threads`), and the BLAS code path.

        Intel MKL, which Paddle's CPU wheel uses for matmuls (``libmklml_intel``), runs a generic
        SSE path on non-Intel CPUs: ~28 GFLOP/s on 2 Zen 3 cores against ~110 with its AVX2 path.
        On an AMD CPU with AVX2 (unless ``kernels = "portable"``) ``MKL_DEBUG_CPU_TYPE=5`` selects
        that path; the MKL-ML build Paddle ships honours it (newer MKL releases ignore it).
        """
        env = dict.fromkeys(_THREAD_VARS, str(self.num_threads()))
        if (self.settings.kernels == "auto" and self.features.vendor == "AuthenticAMD"
                and "avx2" in self.features.present):
            env[MKL_CPU_TYPE_VAR] = MKL_AVX2_CPU_TYPE
        return env

    def prepare_process(self) -> str:
        """With ``keep_freed_memory``, glibc's malloc keeps freed memory (see ``host_tuning``)."""
        if not self.settings.keep_freed_memory:
            return "allocator defaults (keep_freed_memory = false)"
        return host_tuning.keep_freed_memory()

    def memory_profile(self) -> MemoryProfile:
        """Host memory from ``/proc/meminfo``: MemTotal and MemAvailable."""
        return read_meminfo()
