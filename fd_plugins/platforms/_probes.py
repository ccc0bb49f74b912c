"""Device probes shared by the platform plugins, each small enough for tests to replace.

Every probe imports Paddle lazily, so listing plugins stays cheap, and may raise; platforms
turn probes into a :class:`DetectResult` through :func:`detect_with`, which never raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fd_core.contracts.platform import DetectResult, MemoryProfile

if TYPE_CHECKING:
    from collections.abc import Callable


class ProbeUnavailable(Exception):
    """A probe found the platform absent; the message says why and how to fix it."""


def detect_with(probe: Callable[[], int], device: str) -> DetectResult:
    """Run a device-count probe and report the result; never raises.

    ``device`` names the hardware in reasons, e.g. ``"CUDA GPU"``.
    """
    try:
        count = probe()
    except ImportError as exc:
        return DetectResult(False, f"paddle is not importable ({exc}); pip install paddlepaddle")
    except ProbeUnavailable as exc:
        return DetectResult(False, str(exc))
    except Exception as exc:  # a probe must never take start-up down; KeyboardInterrupt passes
        return DetectResult(False, f"{device} probe failed: {type(exc).__name__}: {exc}")
    if count <= 0:
        return DetectResult(False, f"paddle supports {device} but sees no device")
    return DetectResult(True, f"{count} {device} device(s) visible to paddle", count)


def custom_device_count(device_type: str) -> int:
    """Devices of a PaddleCustomDevice plugin type (e.g. ``"iluvatar_gpu"``) that Paddle sees."""
    import paddle

    registered = paddle.device.get_all_custom_device_type()
    if device_type not in registered:
        raise ProbeUnavailable(
            f"paddle has no custom device {device_type!r} (registered: {registered or 'none'}); "
            f"install the PaddleCustomDevice plugin for it")
    prefix = f"{device_type}:"
    return sum(d.startswith(prefix) for d in paddle.device.get_available_custom_device())


def custom_device_memory(device_type: str, device_id: int) -> MemoryProfile:
    """Total and free memory of one custom device.

    Total is the device property ``total_memory``; free is total minus what Paddle's allocator
    has reserved in this process (Paddle exposes no driver-level free-memory query for custom
    devices, so other processes' use is not seen).
    """
    import paddle

    total = int(paddle.device.get_device_properties(f"{device_type}:{device_id}").total_memory)
    reserved = int(paddle.device.cuda.memory_reserved(device_id))  # also serves custom devices
    return MemoryProfile(total_bytes=total, free_bytes=total - reserved)


def smallest(profiles: list[MemoryProfile]) -> MemoryProfile:
    """The profile a rank can rely on when every device must hold the same KV cache."""
    return MemoryProfile(total_bytes=min(p.total_bytes for p in profiles),
                         free_bytes=min(p.free_bytes for p in profiles))
