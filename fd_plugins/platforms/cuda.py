"""The CUDA platform: NVIDIA GPUs through a ``paddlepaddle-gpu`` build."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from fd_core.contracts.platform import FLOAT16, FUSED_RMS_NORM, PAGED_ATTENTION, DetectResult, MemoryProfile, Platform
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.platforms._probes import ProbeUnavailable, detect_with, smallest
from fd_plugins.platforms._settings import DeviceSettings


class CudaSettings(DeviceSettings):
    """``[platform.options]`` of the cuda platform."""


def probe_device_count() -> int:
    """CUDA GPUs Paddle sees; raises ProbeUnavailable on a build without CUDA."""
    import paddle

    if not paddle.is_compiled_with_cuda():
        raise ProbeUnavailable("paddle was built without CUDA; pip install paddlepaddle-gpu")
    return int(paddle.device.cuda.device_count())


def probe_compute_capability(device_id: int) -> tuple[int, int]:
    """(major, minor) compute capability of one GPU."""
    import paddle

    return tuple(paddle.device.cuda.get_device_capability(device_id))  # type: ignore[return-value]


def probe_memory(device_id: int) -> MemoryProfile:
    """Total memory of one GPU and what is left after Paddle's reservations in this process.

    Paddle exposes no ``cudaMemGetInfo``; free is total minus ``memory_reserved``, so memory
    held by other processes on the same GPU is not seen.
    """
    import paddle

    total = int(paddle.device.cuda.get_device_properties(device_id).total_memory)
    return MemoryProfile(total_bytes=total,
                         free_bytes=total - int(paddle.device.cuda.memory_reserved(device_id)))


class CudaPlatform(Platform):
    """NVIDIA GPUs; ``gpu:N`` devices, one worker per local rank."""

    name: ClassVar[str] = "cuda"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel] | None] = CudaSettings
    priority: ClassVar[int] = 50
    capabilities = frozenset({PAGED_ATTENTION, FLOAT16, FUSED_RMS_NORM})

    def __init__(self, settings: BaseModel | None = None) -> None:
        super().__init__(settings if settings is not None else CudaSettings())

    @classmethod
    def detect(cls) -> DetectResult:
        return detect_with(probe_device_count, "CUDA GPU")

    def device_string(self, local_rank: int = 0) -> str:
        return f"gpu:{local_rank}"

    def supported_dtypes(self) -> tuple[str, ...]:
        """bfloat16 first on compute capability >= 8.0 (Ampere), else float16."""
        if probe_compute_capability(0)[0] >= 8:
            return ("bfloat16", "float16", "float32")
        return ("float16", "float32")

    def worker_env(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` from ``device_ids`` when set."""
        assert isinstance(self.settings, CudaSettings)
        visible = self.settings.visible_devices()
        return {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}

    def memory_profile(self) -> MemoryProfile:
        """The smallest total and free memory over the visible GPUs (every rank holds the same
        number of KV blocks)."""
        return smallest([probe_memory(i) for i in range(probe_device_count())])
