"""Tests for the cpu platform: on the real host, and with the CPU feature probe faked."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from fd_core.contracts.platform import BF16_DOT_PRODUCTS, FUSED_RMS_NORM, PAGED_ATTENTION
from fd_plugins.platforms import cpu_features
from fd_plugins.platforms.cpu import CpuPlatform, CpuSettings, read_meminfo
from fd_plugins.platforms.cpu_features import ISA_FEATURES, CpuFeatures


def test_detect_is_available_here() -> None:
    result = CpuPlatform.detect()
    assert result.available and result.device_count == 1
    assert "CPU" in result.reason


def test_memory_profile_is_sane() -> None:
    profile = CpuPlatform().memory_profile()
    assert profile.total_bytes >= profile.free_bytes > 0


def test_read_meminfo_converts_kib(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000 kB\nMemFree:         1000 kB\n"
                       "MemAvailable:    8000 kB\nBuffers:          10 kB\n")
    profile = read_meminfo(str(meminfo))
    assert (profile.total_bytes, profile.free_bytes) == (16000 * 1024, 8000 * 1024)


@pytest.mark.parametrize("utilization", [0.01, 0.3, 0.9])
def test_kv_cache_memory_respects_utilization(utilization: float) -> None:
    platform = CpuPlatform()
    weights, reserve = 100 << 20, 50 << 20
    budget = platform.kv_cache_memory_bytes(utilization=utilization, weights_bytes=weights,
                                            activation_reserve_bytes=reserve)
    profile = platform.memory_profile()
    assert 0 <= budget <= max(0, int(profile.total_bytes * utilization) - weights - reserve)


def test_worker_env_sets_thread_counts() -> None:
    assert CpuPlatform(CpuSettings(num_threads=3)).worker_env()["OMP_NUM_THREADS"] == "3"
    assert CpuPlatform().worker_env()["MKL_NUM_THREADS"] == str(os.cpu_count())


def test_settings_reject_unknown_keys_and_bad_values() -> None:
    with pytest.raises(pydantic.ValidationError):
        CpuSettings.model_validate({"num_thread": 2})
    with pytest.raises(pydantic.ValidationError):
        CpuSettings(num_threads=0)


def test_device_and_dtypes() -> None:
    platform = CpuPlatform()
    assert platform.device_string(3) == "cpu"
    assert platform.supported_dtypes() == ("float32",)


AVX2_ONLY = CpuFeatures("AMD EPYC 7B13", frozenset({"avx2", "fma"}), "/proc/cpuinfo", "AuthenticAMD")
AVX512 = CpuFeatures("Intel Xeon 8481C", frozenset(ISA_FEATURES), "/proc/cpuinfo", "GenuineIntel")
OLD_AMD = CpuFeatures("AMD Opteron", frozenset(), "/proc/cpuinfo", "AuthenticAMD")
ZEN4 = CpuFeatures("AMD EPYC 9B14", frozenset(ISA_FEATURES) - {"avx_vnni", "amx_bf16", "amx_int8"}, "/proc/cpuinfo",
                   "AuthenticAMD")
INTEL_NO_AMX = CpuFeatures("Intel Xeon", ZEN4.present, "/proc/cpuinfo", "GenuineIntel")


@pytest.mark.parametrize(("features", "fused"), [(AVX2_ONLY, False), (AVX512, True)])
def test_capabilities_follow_the_probed_cpu(monkeypatch: pytest.MonkeyPatch, features: CpuFeatures,
                                            fused: bool) -> None:
    monkeypatch.setattr(cpu_features, "probe_cpu_features", lambda: features)
    platform = CpuPlatform()
    assert platform.features is features
    assert (FUSED_RMS_NORM in platform.capabilities) is fused
    assert features.present | {PAGED_ATTENTION} <= platform.capabilities
    assert features.model_name in CpuPlatform.detect().reason


@pytest.mark.parametrize(("features", "dot_products"), [(ZEN4, True), (INTEL_NO_AMX, False), (AVX512, False),
                                                         (AVX2_ONLY, False)])
def test_bf16_dot_products_only_on_amd_cpus_with_avx512_bf16(monkeypatch: pytest.MonkeyPatch, features: CpuFeatures,
                                                             dot_products: bool) -> None:
    monkeypatch.setattr(cpu_features, "probe_cpu_features", lambda: features)
    assert (BF16_DOT_PRODUCTS in CpuPlatform().capabilities) is dot_products
    assert BF16_DOT_PRODUCTS not in CpuPlatform(CpuSettings(kernels="portable")).capabilities


@pytest.mark.parametrize("features", [AVX2_ONLY, AVX512, ZEN4])
def test_portable_kernels_declare_no_isa_capability(monkeypatch: pytest.MonkeyPatch, features: CpuFeatures) -> None:
    monkeypatch.setattr(cpu_features, "probe_cpu_features", lambda: features)
    assert CpuPlatform(CpuSettings(kernels="portable")).capabilities == {PAGED_ATTENTION}


def test_kernels_option_is_validated() -> None:
    with pytest.raises(pydantic.ValidationError, match="kernels"):
        CpuSettings.model_validate({"kernels": "fast"})


def test_detect_reason_lists_the_hosts_features() -> None:
    reason = CpuPlatform.detect().reason
    for feature in ISA_FEATURES:
        assert feature in reason


@pytest.mark.parametrize(("features", "kernels", "avx2_path"), [
    (AVX2_ONLY, "auto", True), (AVX2_ONLY, "portable", False), (AVX512, "auto", False), (OLD_AMD, "auto", False)])
def test_mkl_avx2_path_only_on_amd_cpus_with_avx2(monkeypatch: pytest.MonkeyPatch, features: CpuFeatures,
                                                   kernels: str, avx2_path: bool) -> None:
    monkeypatch.setattr(cpu_features, "probe_cpu_features", lambda: features)
    env = CpuPlatform(CpuSettings(kernels=kernels)).worker_env()
    assert (env.get("MKL_DEBUG_CPU_TYPE") == "5") is avx2_path
    assert avx2_path or "MKL_DEBUG_CPU_TYPE" not in env
