"""Conformance kit for Platform plugins: detection never raises; an available one answers sanely.

Use it from a plugin's own pytest; on a machine without the device only ``detect`` runs (the
other checks are skipped, naming the detector's reason)::

    from fd_core.testing.conformance import check_platform

    def test_my_platform_conforms():
        check_platform(MyPlatform)
        check_platform(MyPlatform, options={"device_ids": [0]})

An available platform is built three ways — ``cls()``, ``cls(settings_model.model_validate({}))``
and, when given, with ``options`` — and each instance must answer every contract method. See
:data:`PLATFORM_CHECKS` for the invariants.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from fd_core.contracts.platform import (
    CPP_KERNELS,
    FLOAT16,
    FUSED_RMS_NORM,
    DetectResult,
    MemoryProfile,
)
from fd_core.testing.conformance._factories import plugin_settings
from fd_core.testing.conformance._report import (
    Check,
    ConformanceError,
    SeamReport,
    Skip,
    broken,
    run_checks,
)

if TYPE_CHECKING:
    from fd_core.contracts.platform import Platform

__all__ = ["PLATFORM_CHECKS", "check_platform", "run_platform_checks"]

SEAM: Final = "platform"
#: Model dtypes the engine knows (``model.dtype``).
KNOWN_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})
#: Capability -> the model dtype it stands for: declared exactly when that dtype is supported.
DTYPE_CAPABILITIES: Final = {FLOAT16: "float16"}
#: x86 ISA feature names a host platform may declare as capabilities (as ``/proc/cpuinfo`` spells them).
X86_FEATURES: Final = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                 "avx512dq", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                                 "amx_tile", "amx_bf16", "amx_int8"})
#: The device string of host memory.
HOST_DEVICE: Final = "cpu"
_MIB: Final = 1 << 20

DETECT: Final = "detect() never raises"
ANSWERS: Final = "an available platform answers every contract method"
DTYPES: Final = "declared capabilities match the supported dtypes"
SAFE: Final = "declared capabilities are safe on this machine"
MEMORY: Final = "the KV budget fits the memory profile"


def check_platform(cls: type[Platform], *, options: Mapping[str, Any] | None = None,
                   skip: Collection[str] = ()) -> SeamReport:
    """Run every platform check; return the report, or raise ConformanceError naming the broken invariants."""
    return run_platform_checks(cls, options=options, skip=skip).raise_for_failures()


def run_platform_checks(cls: type[Platform], *, options: Mapping[str, Any] | None = None,
                        skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_platform`, but never raises for a broken invariant: every check gets a row."""
    return run_checks(SEAM, cls.__name__, PLATFORM_CHECKS, skip=skip, args=(_Kit(cls, options),))


@dataclass(slots=True)
class _Kit:
    cls: type[Platform]
    options: Mapping[str, Any] | None
    detected: DetectResult | None = None   # set by the detect check
    detect_error: str | None = None
    _instances: list[tuple[str, Platform]] | None = None

    def available(self) -> None:
        """Skip the calling check unless detect() said available."""
        if self.detected is None and self.detect_error is None:
            try:
                _detect(self)
            except ConformanceError:
                pass   # the detect check reports it
        if self.detect_error is not None:
            raise Skip(f"detect() raised ({self.detect_error})")
        assert self.detected is not None
        if not self.detected.available:
            raise Skip(f"unavailable here: {self.detected.reason}")

    def instances(self) -> list[tuple[str, Platform]]:
        """(how it was built, instance) for each way the engine may build it."""
        if self._instances is None:
            made: list[tuple[str, Platform]] = [("cls()", _build(lambda: self.cls()))]
            if self.cls.settings_model is not None:
                model = self.cls.settings_model
                made.append((f"cls({model.__name__}.model_validate({{}}))",
                             _build(lambda: self.cls(model.model_validate({})))))
            if self.options:
                made.append((f"cls(options={dict(self.options)!r})",
                             _build(lambda: self.cls(plugin_settings(self.cls, self.options)))))
            self._instances = made
        return self._instances


def _build(make: Any) -> Platform:
    try:
        return make()
    except Exception as exc:
        raise broken(SEAM, ANSWERS, f"building it raised {type(exc).__name__}: {exc}") from exc


def _call(how: str, method: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        raise broken(SEAM, ANSWERS, f"{how}.{method} raised {type(exc).__name__}: {exc}") from exc


# --- the checks ------------------------------------------------------------------------------

def _detect(kit: _Kit) -> None:
    try:
        result = kit.cls.detect()
    except Exception as exc:  # the invariant under test; KeyboardInterrupt passes
        kit.detect_error = f"{type(exc).__name__}: {exc}"
        raise broken(SEAM, DETECT, f"{kit.cls.__name__}.detect() raised {kit.detect_error}") from exc
    if not isinstance(result, DetectResult):
        kit.detect_error = f"returned {result!r}"
        raise broken(SEAM, DETECT, f"detect() returned {result!r}, not a DetectResult")
    if not isinstance(result.available, bool) or not isinstance(result.reason, str) or not result.reason:
        kit.detect_error = f"returned {result!r}"
        raise broken(SEAM, DETECT, f"detect() returned {result!r}: available must be a bool and reason a "
                                   "non-empty string (plugins list and start-up errors show it)")
    if not isinstance(result.device_count, int) or result.device_count < 0:
        kit.detect_error = f"returned {result!r}"
        raise broken(SEAM, DETECT, f"detect() returned device_count={result.device_count!r}")
    kit.detected = result


def _answers(kit: _Kit) -> None:
    kit.available()
    for how, platform in kit.instances():
        device = _call(how, "device_string(0)", partial(platform.device_string, 0))
        if not isinstance(device, str) or not device:
            raise broken(SEAM, ANSWERS, f"{how}.device_string(0) returned {device!r}, not a device string")
        dtypes = _call(how, "supported_dtypes()", platform.supported_dtypes)
        if not isinstance(dtypes, tuple) or not dtypes or not set(dtypes) <= KNOWN_DTYPES:
            raise broken(SEAM, ANSWERS, f"{how}.supported_dtypes() returned {dtypes!r}: a non-empty tuple of "
                                        f"{sorted(KNOWN_DTYPES)}")
        threads = _call(how, "num_threads()", platform.num_threads)
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise broken(SEAM, ANSWERS, f"{how}.num_threads() returned {threads!r}: None or an int >= 1")
        env = _call(how, "worker_env()", platform.worker_env)
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise broken(SEAM, ANSWERS, f"{how}.worker_env() returned {env!r}: a dict of str to str")
        capabilities = platform.capabilities
        if not isinstance(capabilities, (set, frozenset)) or not all(isinstance(c, str) for c in capabilities):
            raise broken(SEAM, ANSWERS, f"{how}.capabilities is {capabilities!r}: a set of strings")
        profile = _call(how, "memory_profile()", platform.memory_profile)
        if not isinstance(profile, MemoryProfile) or not 0 < profile.total_bytes or \
                not 0 <= profile.free_bytes <= profile.total_bytes:
            raise broken(SEAM, ANSWERS, f"{how}.memory_profile() returned {profile!r}: total > 0 and "
                                        "0 <= free <= total bytes")
        budget = _call(how, "kv_cache_memory_bytes(...)", partial(
            platform.kv_cache_memory_bytes, utilization=0.9, weights_bytes=_MIB, activation_reserve_bytes=_MIB))
        if not isinstance(budget, int) or budget <= 0:
            raise broken(SEAM, ANSWERS, f"{how}.kv_cache_memory_bytes(utilization=0.9, weights_bytes=1 MiB, "
                                        f"activation_reserve_bytes=1 MiB) returned {budget!r}; a positive int "
                                        f"of bytes was expected (memory profile {profile})")


def _dtypes_match(kit: _Kit) -> None:
    kit.available()
    for how, platform in kit.instances():
        dtypes = set(platform.supported_dtypes())
        for capability, dtype in DTYPE_CAPABILITIES.items():
            if (capability in platform.capabilities) != (dtype in dtypes):
                said = "declares" if capability in platform.capabilities else "does not declare"
                runs = "supports" if dtype in dtypes else "does not support"
                raise broken(SEAM, DTYPES, f"{how} {said} capability {capability!r} but {runs} dtype {dtype!r} "
                                           f"(supported_dtypes {tuple(platform.supported_dtypes())})")


def _safe_here(kit: _Kit) -> None:
    kit.available()
    flags = _cpu_flags()
    for how, platform in kit.instances():
        capabilities = platform.capabilities
        host = platform.device_string(0) == HOST_DEVICE
        if CPP_KERNELS in capabilities and not host:
            raise broken(SEAM, SAFE, f"{how} declares {CPP_KERNELS!r} (host C++ kernels) on device "
                                     f"{platform.device_string(0)!r}")
        if not host or flags is None:
            continue
        missing = sorted(c for c in capabilities if c in X86_FEATURES and c not in flags)
        if missing:
            raise broken(SEAM, SAFE, f"{how} declares {missing} on a CPU without them (/proc/cpuinfo flags): "
                                     "a kernel picked for them dies with an illegal instruction")
        if FUSED_RMS_NORM in capabilities and "avx512f" not in flags:
            raise broken(SEAM, SAFE, f"{how} declares {FUSED_RMS_NORM!r} on a host CPU without avx512f: Paddle's "
                                     "CPU fused_rms_norm dies there with SIGILL")


def _memory_budget(kit: _Kit) -> None:
    kit.available()
    weights = reserve = 8 * _MIB
    for how, platform in kit.instances():
        budgets = []
        for utilization in (0.1, 0.5, 0.9):
            before = platform.memory_profile()
            budget = platform.kv_cache_memory_bytes(utilization=utilization, weights_bytes=weights,
                                                    activation_reserve_bytes=reserve)
            after = platform.memory_profile()
            cap = max(0, int(max(before.total_bytes, after.total_bytes) * utilization) - weights - reserve)
            free = max(before.free_bytes, after.free_bytes)
            slack = free // 100 + 8 * _MIB   # host memory moves between the reads
            if not 0 <= budget <= cap or budget > free + slack:
                raise broken(SEAM, MEMORY, f"{how}.kv_cache_memory_bytes(utilization={utilization}, weights 8 MiB, "
                                           f"reserve 8 MiB) is {budget} bytes; the profile {after} allows at most "
                                           f"{min(cap, free)} (utilization x total - weights - reserve, and free)")
            budgets.append(budget)
        if budgets != sorted(budgets):
            raise broken(SEAM, MEMORY, f"{how}.kv_cache_memory_bytes shrinks as utilization grows: {budgets} "
                                       "for 0.1, 0.5, 0.9")
        total = platform.memory_profile().total_bytes
        huge = platform.kv_cache_memory_bytes(utilization=0.9, weights_bytes=total, activation_reserve_bytes=reserve)
        if huge != 0:
            raise broken(SEAM, MEMORY, f"{how}.kv_cache_memory_bytes is {huge} bytes with weights as large as "
                                       "the whole memory; it must be 0")


def _cpu_flags() -> frozenset[str] | None:
    """The host CPU's ``/proc/cpuinfo`` flags, or None where there are none to read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        return None
    return None


#: The platform kit, in the order it runs.
PLATFORM_CHECKS: Final = (
    Check("detect", DETECT, _detect),
    Check("answers", ANSWERS, _answers),
    Check("dtypes_match_capabilities", DTYPES, _dtypes_match),
    Check("capabilities_safe_here", SAFE, _safe_here),
    Check("memory_budget", MEMORY, _memory_budget),
)
