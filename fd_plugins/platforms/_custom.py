"""Base class of the platforms that come as PaddleCustomDevice plugins (iluvatar, hpu)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from fd_core.contracts.platform import DetectResult, MemoryProfile, Platform
from fd_plugins.platforms import _probes
from fd_plugins.platforms._settings import DeviceSettings


class CustomDevicePlatform(Platform):
    """A Paddle custom device type; subclasses name it and its visible-devices variable.

    Detection and memory go through :mod:`fd_plugins.platforms._probes`, looked up at call
    time so tests can replace the probes.
    """

    #: Paddle's custom device type, e.g. ``"iluvatar_gpu"``; also the device string prefix.
    device_type: ClassVar[str]
    #: Hardware name used in detection reasons.
    device_label: ClassVar[str]
    #: Environment variable restricting the devices a worker sees.
    visible_devices_var: ClassVar[str]
    #: Model dtypes, most preferred first.
    dtypes: ClassVar[tuple[str, ...]]

    def __init__(self, settings: BaseModel | None = None) -> None:
        assert self.settings_model is not None
        super().__init__(settings if settings is not None else self.settings_model())

    @classmethod
    def detect(cls) -> DetectResult:
        return _probes.detect_with(lambda: _probes.custom_device_count(cls.device_type),
                                   cls.device_label)

    def device_string(self, local_rank: int = 0) -> str:
        return f"{self.device_type}:{local_rank}"

    def supported_dtypes(self) -> tuple[str, ...]:
        return self.dtypes

    def worker_env(self) -> dict[str, str]:
        """The visible-devices variable from ``device_ids`` when set."""
        assert isinstance(self.settings, DeviceSettings)
        visible = self.settings.visible_devices()
        return {} if visible is None else {self.visible_devices_var: visible}

    def memory_profile(self) -> MemoryProfile:
        """The smallest total and free memory over the visible devices
        (see :func:`~fd_plugins.platforms._probes.custom_device_memory`)."""
        count = _probes.custom_device_count(self.device_type)
        return _probes.smallest([_probes.custom_device_memory(self.device_type, i)
                                 for i in range(count)])
