"""The CPU platform: runs everywhere Paddle runs, with host memory as the KV cache pool."""

from __future__ import annotations

import os
from typing import ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.platform import DetectResult, MemoryProfile, Platform

#: Environment variables that size the thread pools of OpenMP, MKL and OpenBLAS.
_THREAD_VARS: Final = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class CpuSettings(BaseModel):
    """``[platform.options]`` of the cpu platform."""

    model_config = ConfigDict(extra="forbid")

    num_threads: int | None = Field(
        None, ge=1, description="Math threads per worker (Paddle, OpenMP, MKL); None: every usable CPU.")


def read_meminfo(path: str = "/proc/meminfo") -> MemoryProfile:
    """Host MemTotal and MemAvailable (Linux ``/proc/meminfo``, kB) in bytes."""
    fields: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return MemoryProfile(total_bytes=fields["MemTotal"], free_bytes=fields["MemAvailable"])


class CpuPlatform(Platform):
    """Float32 execution on the host CPU; the fallback when no accelerator is found."""

    name: ClassVar[str] = "cpu"
    fd_hookspec_version: ClassVar[int] = 1
    settings_model: ClassVar[type[BaseModel] | None] = CpuSettings
    priority: ClassVar[int] = 0
    capabilities: ClassVar[frozenset[str]] = frozenset({"paged_attention"})

    def __init__(self, settings: BaseModel | None = None) -> None:
        super().__init__(settings if settings is not None else CpuSettings())

    @classmethod
    def detect(cls) -> DetectResult:
        return DetectResult(True, f"host CPU ({len(os.sched_getaffinity(0))} usable cores)", 1)

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        # Paddle's CPU kernels cover float32 fully; bfloat16/float16 matmuls are slow or missing.
        return ("float32",)

    def num_threads(self) -> int:
        """``num_threads`` or every CPU this process may run on."""
        assert isinstance(self.settings, CpuSettings)
        return self.settings.num_threads or len(os.sched_getaffinity(0))

    def worker_env(self) -> dict[str, str]:
        """Thread counts for OpenMP/MKL/OpenBLAS, the same as :meth:`num_threads`."""
        return dict.fromkeys(_THREAD_VARS, str(self.num_threads()))

    def memory_profile(self) -> MemoryProfile:
        """Host memory from ``/proc/meminfo``: MemTotal and MemAvailable."""
        return read_meminfo()
