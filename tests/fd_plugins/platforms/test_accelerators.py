"""Tests for the cuda, xpu, iluvatar and hpu platforms.

The hardware is not here, so "available" is tested by faking the Paddle functions the probes
call (the probes themselves run); the unfaked tests check this CPU-only build reports them
unavailable without raising.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import paddle
import pydantic
import pytest

from fd_core.contracts.platform import Platform
from fd_plugins.platforms.cuda import CudaPlatform
from fd_plugins.platforms.hpu import HpuPlatform
from fd_plugins.platforms.iluvatar import IluvatarPlatform
from fd_plugins.platforms.xpu import XpuPlatform

if TYPE_CHECKING:
    from collections.abc import Callable

GIB = 1 << 30


@dataclass(frozen=True)
class Case:
    cls: type[Platform]
    device_prefix: str          # device string before ":N"
    visible_var: str            # what worker_env sets from device_ids
    fake: Callable[[pytest.MonkeyPatch, list[int], list[int]], None]   # (totals, used)
    break_probe: Callable[[pytest.MonkeyPatch, Exception], None]


def _raiser(exc: Exception) -> Callable[..., object]:
    def raise_(*_args: object) -> object:
        raise exc
    return raise_


def _fake_cuda(mp: pytest.MonkeyPatch, totals: list[int], used: list[int]) -> None:
    mp.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    mp.setattr(paddle.device.cuda, "device_count", lambda: len(totals))
    mp.setattr(paddle.device.cuda, "get_device_properties",
               lambda i: SimpleNamespace(total_memory=totals[i]))
    mp.setattr(paddle.device.cuda, "memory_reserved", lambda i: used[i])
    mp.setattr(paddle.device.cuda, "get_device_capability", lambda i: (8, 0))


def _break_cuda(mp: pytest.MonkeyPatch, exc: Exception) -> None:
    mp.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    mp.setattr(paddle.device.cuda, "device_count", _raiser(exc))


def _fake_xpu(mp: pytest.MonkeyPatch, totals: list[int], used: list[int]) -> None:
    mp.setattr(paddle, "is_compiled_with_xpu", lambda: True)
    mp.setattr(paddle.device.xpu, "device_count", lambda: len(totals))
    mp.setattr(paddle.device.xpu, "memory_total", lambda i: totals[i])
    mp.setattr(paddle.device.xpu, "memory_used", lambda i: used[i])


def _break_xpu(mp: pytest.MonkeyPatch, exc: Exception) -> None:
    mp.setattr(paddle, "is_compiled_with_xpu", _raiser(exc))


def _fake_custom(device_type: str) -> Callable[[pytest.MonkeyPatch, list[int], list[int]], None]:
    def fake(mp: pytest.MonkeyPatch, totals: list[int], used: list[int]) -> None:
        mp.setattr(paddle.device, "get_all_custom_device_type", lambda: ["npu", device_type])
        mp.setattr(paddle.device, "get_available_custom_device",
                   lambda: ["npu:0"] + [f"{device_type}:{i}" for i in range(len(totals))])
        mp.setattr(paddle.device, "get_device_properties",
                   lambda d: SimpleNamespace(total_memory=totals[int(d.split(":")[1])]))
        mp.setattr(paddle.device.cuda, "memory_reserved", lambda i: used[i])
    return fake


def _break_custom(mp: pytest.MonkeyPatch, exc: Exception) -> None:
    mp.setattr(paddle.device, "get_all_custom_device_type", _raiser(exc))


CASES = [
    Case(CudaPlatform, "gpu", "CUDA_VISIBLE_DEVICES", _fake_cuda, _break_cuda),
    Case(XpuPlatform, "xpu", "XPU_VISIBLE_DEVICES", _fake_xpu, _break_xpu),
    Case(IluvatarPlatform, "iluvatar_gpu", "CUDA_VISIBLE_DEVICES",
         _fake_custom("iluvatar_gpu"), _break_custom),
    Case(HpuPlatform, "intel_hpu", "INTEL_HPU_VISIBLE_DEVICES",
         _fake_custom("intel_hpu"), _break_custom),
]
by_name = pytest.mark.parametrize("case", CASES, ids=[c.cls.name for c in CASES])


@by_name
def test_unavailable_here_for_real(case: Case) -> None:
    result = case.cls.detect()
    assert not result.available and result.device_count == 0
    assert result.reason


@by_name
def test_detected_with_faked_devices(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    case.fake(monkeypatch, [16 * GIB, 16 * GIB], [0, 0])
    result = case.cls.detect()
    assert result.available and result.device_count == 2, result
    platform = case.cls()
    assert platform.device_string(1) == f"{case.device_prefix}:1"
    assert platform.supported_dtypes()[-1] == "float32"


@by_name
def test_memory_profile_takes_the_smallest_device(case: Case,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    case.fake(monkeypatch, [32 * GIB, 24 * GIB], [1 * GIB, 10 * GIB])
    profile = case.cls().memory_profile()
    assert (profile.total_bytes, profile.free_bytes) == (24 * GIB, 14 * GIB)
    budget = case.cls().kv_cache_memory_bytes(utilization=0.5, weights_bytes=2 * GIB,
                                              activation_reserve_bytes=1 * GIB)
    assert budget == 12 * GIB - 3 * GIB


@by_name
def test_no_devices_means_unavailable(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    case.fake(monkeypatch, [], [])
    result = case.cls.detect()
    assert not result.available and "no device" in result.reason


@by_name
def test_raising_probe_is_reported_not_raised(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    case.break_probe(monkeypatch, RuntimeError("driver exploded"))
    result = case.cls.detect()
    assert not result.available
    assert "RuntimeError: driver exploded" in result.reason


@by_name
def test_missing_paddle_is_reported(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "paddle", None)   # makes `import paddle` raise ImportError
    result = case.cls.detect()
    assert not result.available and "paddle is not importable" in result.reason


@by_name
def test_worker_env_and_settings(case: Case) -> None:
    settings_model = case.cls.settings_model
    assert settings_model is not None
    assert case.cls().worker_env() == {}
    chosen = case.cls(settings_model(device_ids=[2, 3]))
    assert chosen.worker_env() == {case.visible_var: "2,3"}
    with pytest.raises(pydantic.ValidationError):
        settings_model.model_validate({"device_id": [0]})
    with pytest.raises(pydantic.ValidationError):
        settings_model(device_ids=[-1])


def test_accelerators_outrank_cpu() -> None:
    from fd_plugins.platforms.cpu import CpuPlatform

    assert min(c.cls.priority for c in CASES) > CpuPlatform.priority
    assert len({c.cls.priority for c in CASES}) == len(CASES)


def test_cuda_prefers_bfloat16_from_ampere_on(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, [GIB], [0])
    assert CudaPlatform().supported_dtypes()[0] == "bfloat16"
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda i: (7, 5))
    assert CudaPlatform().supported_dtypes() == ("float16", "float32")
