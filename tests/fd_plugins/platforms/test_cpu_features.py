"""The CPU feature probe: /proc/cpuinfo parsing, the Paddle fallback, and the real host."""

from __future__ import annotations

import pytest

from fd_plugins.platforms import cpu_features
from fd_plugins.platforms.cpu_features import ISA_FEATURES, CpuFeatures, parse_cpuinfo, probe_cpu_features

# Shortened from real machines of both families used by this project.
AMD_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes
"""
INTEL_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 fma avx avx2 avx_vnni avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""  # noqa: E501


def test_amd_epyc_has_avx2_and_fma_only() -> None:
    model, flags, vendor = parse_cpuinfo(AMD_EPYC)
    assert (model, vendor) == ("AMD EPYC 7B13", "AuthenticAMD")
    assert frozenset(ISA_FEATURES) & flags == {"avx2", "fma"}


def test_intel_xeon_has_every_probed_feature() -> None:
    model, flags, vendor = parse_cpuinfo(INTEL_XEON)
    assert model.startswith("Intel(R) Xeon(R) Platinum 8481C") and vendor == "GenuineIntel"
    assert frozenset(ISA_FEATURES) <= flags


@pytest.mark.parametrize(("text", "present"), [(AMD_EPYC, {"avx2", "fma"}), (INTEL_XEON, set(ISA_FEATURES))])
def test_probe_reads_cpuinfo(monkeypatch: pytest.MonkeyPatch, text: str, present: set[str]) -> None:
    monkeypatch.setattr(cpu_features, "read_cpuinfo", lambda: text)
    found = probe_cpu_features()
    assert found.present == present and found.source == "/proc/cpuinfo"


@pytest.mark.parametrize("avx512f", [True, False])
def test_without_cpuinfo_flags_paddle_answers_for_avx512f(monkeypatch: pytest.MonkeyPatch, avx512f: bool) -> None:
    monkeypatch.setattr(cpu_features, "read_cpuinfo", lambda: "")
    monkeypatch.setattr(cpu_features, "paddle_supports_avx512f", lambda: avx512f)
    found = probe_cpu_features()
    assert found.present == ({"avx512f"} if avx512f else set()) and found.source == "paddle"
    assert found.model_name  # never empty


def test_a_failing_fallback_probe_means_no_optional_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("no cpuid here")

    monkeypatch.setattr(cpu_features, "read_cpuinfo", lambda: "")
    monkeypatch.setattr(cpu_features, "paddle_supports_avx512f", broken)
    assert probe_cpu_features().present == frozenset()


def test_describe_names_model_present_and_missing_features() -> None:
    text = CpuFeatures("AMD EPYC", frozenset({"avx2", "fma"}), "/proc/cpuinfo").describe()
    assert text == "AMD EPYC: avx2 fma; lacks avx_vnni avx512f avx512vl avx512_bf16 avx512_vnni amx_bf16 amx_int8"
    assert CpuFeatures("Xeon", frozenset(ISA_FEATURES), "/proc/cpuinfo").describe() == f"Xeon: {' '.join(ISA_FEATURES)}"


def test_this_host_agrees_with_paddles_own_cpuid_check() -> None:
    """The real probe, nothing faked: /proc/cpuinfo and Paddle must agree on AVX-512F."""
    found = probe_cpu_features()
    assert found.source == "/proc/cpuinfo"
    assert ("avx512f" in found.present) == cpu_features.paddle_supports_avx512f()
    assert "avx2" in found.present, "the engine's supported CPUs all have AVX2 (README)"
