"""The HPU platform: Intel Gaudi through the ``intel_hpu`` Paddle custom device."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from fd_core.contracts.platform import PAGED_ATTENTION
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.platforms._custom import CustomDevicePlatform
from fd_plugins.platforms._settings import DeviceSettings


class HpuSettings(DeviceSettings):
    """``[platform.options]`` of the hpu platform."""


class HpuPlatform(CustomDevicePlatform):
    """Intel Gaudi HPUs; ``intel_hpu:N`` devices, visibility through
    ``INTEL_HPU_VISIBLE_DEVICES`` (the variable FastDeploy's Gaudi guide sets)."""

    name: ClassVar[str] = "hpu"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel] | None] = HpuSettings
    priority: ClassVar[int] = 30
    capabilities = frozenset({PAGED_ATTENTION})
    device_type: ClassVar[str] = "intel_hpu"
    device_label: ClassVar[str] = "Intel HPU"
    visible_devices_var: ClassVar[str] = "INTEL_HPU_VISIBLE_DEVICES"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float32")
