"""Probe the host CPU: its model name and the instruction-set features the kernels care about.

The kernel's view (``/proc/cpuinfo`` flags) is the source: it already hides features the OS
does not enable (AVX-512 state saving under some hypervisors, AMX without the permission
syscall). Where that file is missing or has no flags (not Linux, some containers), Paddle's own
``supports_avx512f()`` answers for ``avx512f``, and the rest count as absent: a kernel is only
picked when a feature is known to be there.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Final

#: Features the cpu platform reports and may turn into capabilities, in display order.
ISA_FEATURES: Final = ("avx2", "fma", "avx_vnni", "avx512f", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16",
                        "amx_int8")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What :func:`probe_cpu_features` found."""

    model_name: str              # e.g. "AMD EPYC 7B13" ("unknown CPU" when not reported)
    present: frozenset[str]      # the subset of ISA_FEATURES this CPU (and OS) supports
    source: str                  # where ``present`` came from: "/proc/cpuinfo" or "paddle"
    vendor: str = ""             # cpuid vendor string, e.g. "AuthenticAMD", "GenuineIntel"; "" if unknown

    def missing(self) -> tuple[str, ...]:
        """ISA_FEATURES absent here, in display order."""
        return tuple(f for f in ISA_FEATURES if f not in self.present)

    def describe(self) -> str:
        """One phrase, e.g. ``AMD EPYC: avx2 fma; lacks avx512f avx512_bf16 ...``."""
        have = " ".join(f for f in ISA_FEATURES if f in self.present) or "none of the probed features"
        missing = self.missing()
        return f"{self.model_name}: {have}" + (f"; lacks {' '.join(missing)}" if missing else "")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str], str]:
    """The first ``model name``, ``flags`` and ``vendor_id`` of a ``/proc/cpuinfo`` text (x86 layout)."""
    model, flags, vendor = "", frozenset[str](), ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
    return model, flags, vendor


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    """The text of ``/proc/cpuinfo``, or ``""`` where it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def paddle_supports_avx512f() -> bool:
    """Paddle's own cpuid check (used only when ``/proc/cpuinfo`` has no flags)."""
    import paddle

    return bool(paddle.base.core.supports_avx512f())


def probe_cpu_features() -> CpuFeatures:
    """Model name and ISA features of the CPU this process runs on; never raises."""
    model, flags, vendor = parse_cpuinfo(read_cpuinfo())
    model = model or platform.processor() or "unknown CPU"
    if flags:
        return CpuFeatures(model, frozenset(ISA_FEATURES) & flags, "/proc/cpuinfo", vendor)
    try:
        avx512f = paddle_supports_avx512f()
    except Exception:  # no paddle, or a build without the probe: assume nothing optional
        avx512f = False
    return CpuFeatures(model, frozenset({"avx512f"} if avx512f else ()), "paddle", vendor)
