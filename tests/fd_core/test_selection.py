"""Start-up resolution: an explicit platform's worker env is in place before its probe runs."""

from __future__ import annotations

import os
from typing import ClassVar

from fd_core.config import load_config
from fd_core.contracts.platform import DetectResult, MemoryProfile, Platform
from fd_core.registry import Registry
from fd_core.selection import resolve
from fd_plugins.resource_managers.v1.manager import V1ResourceManager
from fd_plugins.schedulers.local import LocalScheduler
from fd_plugins.token_processors.default import DefaultTokenProcessor


class EnvProbe(Platform):
    """Records what the environment said when detect() ran."""

    name: ClassVar[str] = "envprobe"
    fd_hookspec_version: ClassVar[int] = 1
    seen: ClassVar[str | None] = None

    @classmethod
    def detect(cls) -> DetectResult:
        EnvProbe.seen = os.environ.get("FD_TEST_VISIBLE")
        return DetectResult(True, "always", 1)

    def worker_env(self) -> dict[str, str]:
        return {"FD_TEST_VISIBLE": "3,4"}

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        return ("float32",)

    def memory_profile(self) -> MemoryProfile:
        return MemoryProfile(1 << 30, 1 << 30)


def _registry() -> Registry:
    return Registry.from_plugins({"platform": [EnvProbe], "scheduler": [LocalScheduler],
                                  "resource_manager": [V1ResourceManager], "token_processor": [DefaultTokenProcessor]})


def test_explicit_platform_env_is_applied_before_detection(monkeypatch):
    monkeypatch.delenv("FD_TEST_VISIBLE", raising=False)
    config = load_config(platform={"name": "envprobe"})
    resolve(config, _registry())                       # --check: no side effects
    assert EnvProbe.seen is None and "FD_TEST_VISIBLE" not in os.environ
    selection = resolve(config, _registry(), apply_worker_env=True)
    assert EnvProbe.seen == "3,4"
    assert selection.platform_reason == "explicit: always"
