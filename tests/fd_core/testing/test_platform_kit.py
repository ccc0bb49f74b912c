"""The platform kit: every built-in's detector never raises; cpu passes every check; broken platforms are named."""

from __future__ import annotations

from typing import ClassVar

import pytest

from fd_core.contracts.platform import FLOAT16, DetectResult, MemoryProfile, Platform
from fd_core.testing.conformance import (
    ConformanceError,
    check_platform,
    run_platform_checks,
)
from fd_core.testing.conformance.platform import X86_FEATURES, _cpu_flags
from fd_plugins.platforms.cpu import CpuPlatform
from fd_plugins.platforms.cuda import CudaPlatform
from fd_plugins.platforms.hpu import HpuPlatform
from fd_plugins.platforms.iluvatar import IluvatarPlatform
from fd_plugins.platforms.xpu import XpuPlatform


def test_cpu_passes_every_check_with_default_and_given_options():
    for options in (None, {"kernels": "portable", "num_threads": 1}):
        report = check_platform(CpuPlatform, options=options)
        assert all(r.status == "passed" for r in report.results), report


@pytest.mark.parametrize("cls", [CudaPlatform, XpuPlatform, IluvatarPlatform, HpuPlatform])
def test_unavailable_accelerators_pass_detect_and_skip_the_rest(cls):
    report = check_platform(cls)
    assert report.result("detect").status == "passed"
    assert {r.status for r in report.results[1:]} == {"skipped"}
    assert report.results[1].reason.startswith("unavailable here: ")


def test_a_platform_whose_detector_raises_is_caught(broken_plugins):
    with pytest.raises(ConformanceError) as caught:
        check_platform(broken_plugins.platform.RaisingDetector)
    assert str(caught.value) == ("platform invariant 'detect() never raises' broken: RaisingDetector.detect() raised "
                                 "RuntimeError: the device probe exploded (no driver library)")


class _Host(Platform):
    name: ClassVar[str] = "host"
    fd_hookspec_version: ClassVar[int] = 3

    @classmethod
    def detect(cls) -> DetectResult:
        return DetectResult(True, "always", 1)

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        return ("float32",)

    def memory_profile(self) -> MemoryProfile:
        return MemoryProfile(total_bytes=8 << 30, free_bytes=4 << 30)


class _Float16WithoutDtype(_Host):
    capabilities = frozenset({FLOAT16})


class _ClaimsMissingIsa(_Host):
    capabilities = frozenset(X86_FEATURES - (_cpu_flags() or frozenset()))


class _PromisesTooMuch(_Host):
    def kv_cache_memory_bytes(self, *, utilization: float, weights_bytes: int, activation_reserve_bytes: int) -> int:
        return 16 << 30


class _BadEnv(_Host):
    def worker_env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": 4}  # type: ignore[dict-item]


@pytest.mark.parametrize(("cls", "check", "message"), [
    (_Float16WithoutDtype, "dtypes_match_capabilities", "platform invariant 'declared capabilities match the "
                                                        "supported dtypes' broken: cls() declares capability 'float16' "
                                                        "but does not support dtype 'float16'"),
    (_ClaimsMissingIsa, "capabilities_safe_here", "platform invariant 'declared capabilities are safe on this "
                                                  "machine' broken: cls() declares ["),
    (_PromisesTooMuch, "memory_budget", "platform invariant 'the KV budget fits the memory profile' broken: "
                                        "cls().kv_cache_memory_bytes(utilization=0.1"),
    (_BadEnv, "answers", "platform invariant 'an available platform answers every contract method' broken: "
                         "cls().worker_env() returned {'OMP_NUM_THREADS': 4}: a dict of str to str"),
])
def test_each_broken_platform_fails_naming_its_invariant(cls, check, message):
    if cls is _ClaimsMissingIsa and not cls.capabilities:
        pytest.skip("this CPU has every x86 feature the kit knows")
    report = run_platform_checks(cls)
    assert message in report.result(check).reason, report.result(check).reason
