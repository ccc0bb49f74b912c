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
        None, ge=1, description="Threads per worker for OpenMP/MKL; None uses os.cpu_count().")


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
        return DetectResult(True, f"host CPU ({os.cpu_count()} cores)", 1)

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        # Paddle's CPU kernels cover float32 fully; bfloat16/float16 matmuls are slow or missing.
        return ("float32",)

    def worker_env(self) -> dict[str, str]:
        """Thread counts for OpenMP/MKL/OpenBLAS: ``num_threads`` or every core."""
        assert isinstance(self.settings, CpuSettings)
        threads = str(self.settings.num_threads or os.cpu_count() or 1)
        return dict.fromkeys(_THREAD_VARS, threads)

    def memory_profile(self) -> MemoryProfile:
        """Host memory from ``/proc/meminfo``: MemTotal and MemAvailable."""
        return read_meminfo()
