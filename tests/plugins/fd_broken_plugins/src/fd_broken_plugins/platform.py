"""A platform whose detector raises (breaks "detect() never raises")."""

from __future__ import annotations

from typing import ClassVar

from fd_core import DetectResult, MemoryProfile, Platform


class RaisingDetector(Platform):
    """Probes a device the careless way: any error in the probe escapes detect()."""

    name: ClassVar[str] = "raising-detector"
    fd_hookspec_version: ClassVar[int] = 3

    @classmethod
    def detect(cls) -> DetectResult:
        raise RuntimeError("the device probe exploded (no driver library)")

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        return ("float32",)

    def memory_profile(self) -> MemoryProfile:
        return MemoryProfile(total_bytes=1 << 30, free_bytes=1 << 30)
