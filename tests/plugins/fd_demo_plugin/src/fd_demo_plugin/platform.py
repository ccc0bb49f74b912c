"""A platform that is available only when FD_DEMO_DEVICE=1 is set."""

from __future__ import annotations

import os
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from fd_core import DetectResult, MemoryProfile, Platform


class DemoPlatformSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lanes: int = 1


class DemoPlatform(Platform):
    """Runs on the CPU under another name; proves third-party platforms are selectable."""

    name: ClassVar[str] = "demo"
    fd_hookspec_version: ClassVar[int] = 2
    settings_model: ClassVar[type[BaseModel]] = DemoPlatformSettings
    priority: ClassVar[int] = -10

    @classmethod
    def detect(cls) -> DetectResult:
        on = os.environ.get("FD_DEMO_DEVICE") == "1"
        return DetectResult(on, "FD_DEMO_DEVICE=1" if on else "FD_DEMO_DEVICE is not 1", int(on))

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        return ("float32",)

    def memory_profile(self) -> MemoryProfile:
        return MemoryProfile(total_bytes=1 << 30, free_bytes=1 << 30)
