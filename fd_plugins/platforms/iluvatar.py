"""The Iluvatar platform: Iluvatar CoreX GPUs through the ``iluvatar_gpu`` Paddle custom device."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from fd_core.contracts.platform import FLOAT16, PAGED_ATTENTION
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.platforms._custom import CustomDevicePlatform
from fd_plugins.platforms._settings import DeviceSettings


class IluvatarSettings(DeviceSettings):
    """``[platform.options]`` of the iluvatar platform."""


class IluvatarPlatform(CustomDevicePlatform):
    """Iluvatar CoreX GPUs; ``iluvatar_gpu:N`` devices. CoreX is CUDA-compatible, so device
    visibility uses ``CUDA_VISIBLE_DEVICES``."""

    name: ClassVar[str] = "iluvatar"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel] | None] = IluvatarSettings
    priority: ClassVar[int] = 20
    capabilities = frozenset({PAGED_ATTENTION, FLOAT16})
    device_type: ClassVar[str] = "iluvatar_gpu"
    device_label: ClassVar[str] = "Iluvatar GPU"
    visible_devices_var: ClassVar[str] = "CUDA_VISIBLE_DEVICES"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
