"""The XPU platform: Kunlunxin XPUs through Paddle's XPU build."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from fd_core.contracts.platform import FLOAT16, PAGED_ATTENTION, DetectResult, MemoryProfile, Platform
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.platforms._probes import ProbeUnavailable, detect_with, smallest
from fd_plugins.platforms._settings import DeviceSettings


class XpuSettings(DeviceSettings):
    """``[platform.options]`` of the xpu platform."""


def probe_device_count() -> int:
    """XPUs Paddle sees; raises ProbeUnavailable on a build without XPU support."""
    import paddle

    if not paddle.is_compiled_with_xpu():
        raise ProbeUnavailable("paddle was built without XPU support; install the paddlepaddle-xpu build")
    return int(paddle.device.xpu.device_count())


def probe_memory(device_id: int) -> MemoryProfile:
    """Total and free memory of one XPU as the XPU runtime reports them
    (``paddle.device.xpu.memory_total`` and ``memory_used``)."""
    import paddle

    total = int(paddle.device.xpu.memory_total(device_id))
    return MemoryProfile(total_bytes=total,
                         free_bytes=total - int(paddle.device.xpu.memory_used(device_id)))


class XpuPlatform(Platform):
    """Kunlunxin XPUs; ``xpu:N`` devices, one worker per local rank."""

    name: ClassVar[str] = "xpu"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel] | None] = XpuSettings
    priority: ClassVar[int] = 40
    capabilities = frozenset({PAGED_ATTENTION, FLOAT16})

    def __init__(self, settings: BaseModel | None = None) -> None:
        super().__init__(settings if settings is not None else XpuSettings())

    @classmethod
    def detect(cls) -> DetectResult:
        return detect_with(probe_device_count, "XPU")

    def device_string(self, local_rank: int = 0) -> str:
        return f"xpu:{local_rank}"

    def supported_dtypes(self) -> tuple[str, ...]:
        return ("bfloat16", "float16", "float32")

    def worker_env(self) -> dict[str, str]:
        """``XPU_VISIBLE_DEVICES`` from ``device_ids`` when set."""
        assert isinstance(self.settings, XpuSettings)
        visible = self.settings.visible_devices()
        return {} if visible is None else {"XPU_VISIBLE_DEVICES": visible}

    def memory_profile(self) -> MemoryProfile:
        """The smallest total and free memory over the visible XPUs."""
        return smallest([probe_memory(i) for i in range(probe_device_count())])
