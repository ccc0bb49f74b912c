"""The engine process's resident memory by part, measured once when start-up ends.

Three parts add up to the resident set (``VmRSS``): the weights as the kernels hold them (packed
for MKL, bfloat16 panels, int8 codes, GGUF blocks, or plain float32 for the portable kernels:
the distinct arrays the model reaches), the KV pool, and the rest, called the runtime: the
interpreter, Paddle and the other libraries, the tokenizer, and what the warm-up's steps left in the
allocator. The weights and the pool are counted in resident pages (``mincore``), not in allocated
bytes: MKL allocates a packed weight several times larger than the pages it writes (see
``fd_kernels/csrc/fresh_pages.h``). ``VmHWM`` is the peak so far, normally the model load's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import paddle

#: Modules whose objects the walk of a model looks into (the model, its layers, prepared weights).
_OWN_MODULES: Final = ("fd_core.", "fd_kernels.", "fd_plugins.")
_PAGE: Final = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """Bytes by part; ``resident`` and ``peak_resident`` are 0 where ``/proc`` is missing."""

    weights: int         # resident pages of the arrays the model holds, in the kernels' layouts
    kv_cache: int        # resident pages of the KV pool (all of it: it is zeroed at start-up)
    resident: int        # VmRSS when start-up ended
    peak_resident: int   # VmHWM then: the highest resident so far

    @property
    def runtime(self) -> int:
        """``resident`` less the weights and the KV pool (0 when ``resident`` is unknown)."""
        return max(0, self.resident - self.weights - self.kv_cache)

    def as_dict(self) -> dict[str, int]:
        """The figures by name, ``runtime`` included (``EngineStats.memory``)."""
        return {**dataclasses.asdict(self), "runtime": self.runtime}

    def describe(self) -> str:
        """``1,234 MiB resident (peak 1,300 MiB): weights 600 MiB as the kernels hold them, ...``."""
        def mib(n: int) -> str:
            return f"{n >> 20:,} MiB"

        return (f"{mib(self.resident)} resident (peak {mib(self.peak_resident)}): weights {mib(self.weights)} "
                f"as the kernels hold them, KV pool {mib(self.kv_cache)}, runtime {mib(self.runtime)}")


def measure_memory(model: Any, kv_caches: Any) -> MemoryUsage:
    """The parts of this process's resident memory now, ``model`` and ``kv_caches`` as a runner holds them."""
    resident, peak = process_resident_bytes()
    return MemoryUsage(weights=resident_bytes(held_arrays(model)), kv_cache=resident_bytes(held_arrays(kv_caches)),
                       resident=resident, peak_resident=peak)


def held_arrays(root: Any) -> list[paddle.Tensor | np.ndarray]:
    """The distinct arrays (Paddle tensors, numpy arrays that own their data) reachable from ``root``
    through lists, tuples, dicts and the attributes of fd-engine's own objects; an array shared by
    two owners, or seen through a view, is listed once."""
    distinct: dict[tuple[str, int], paddle.Tensor | np.ndarray] = {}
    for array in _arrays(root):
        if isinstance(array, np.ndarray):
            while isinstance(array.base, np.ndarray):
                array = array.base
            distinct["numpy", id(array)] = array
        elif array._is_initialized():
            distinct["paddle", array.data_ptr()] = array
    return list(distinct.values())


def array_span(array: paddle.Tensor | np.ndarray) -> tuple[int, int]:
    """``(address, bytes)`` of an array's data."""
    if isinstance(array, np.ndarray):
        return array.__array_interface__["data"][0], array.nbytes
    return array.data_ptr(), math.prod(array.shape) * array.element_size()


def resident_bytes(arrays: list[paddle.Tensor | np.ndarray]) -> int:
    """Bytes of the resident pages under ``arrays`` (a page two arrays share counts once); where
    ``mincore`` cannot tell (no such call), the arrays' bytes."""
    mincore = _mincore()
    total, counted_to = 0, 0
    for address, size in sorted(map(array_span, arrays)):
        first = max(address // _PAGE * _PAGE, counted_to)
        end = -(-(address + size) // _PAGE) * _PAGE
        if end <= first:
            continue
        flags = (ctypes.c_ubyte * ((end - first) // _PAGE))()
        if mincore is None or mincore(ctypes.c_void_p(first), end - first, flags) != 0:
            total += size
        else:
            total += int(np.count_nonzero(np.frombuffer(flags, np.uint8) & 1)) * _PAGE
        counted_to = end
    return total


def _mincore() -> Any:
    try:
        call = ctypes.CDLL(None).mincore
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    call.restype = ctypes.c_int
    return call


def _arrays(root: Any) -> Iterator[paddle.Tensor | np.ndarray]:
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (paddle.Tensor, np.ndarray)):
            yield obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith(_OWN_MODULES):
            stack.extend(_attributes(obj))


def _attributes(obj: Any) -> Iterator[Any]:
    """The values of ``obj``'s instance attributes, in ``__dict__`` and in the slots of its classes."""
    yield from getattr(obj, "__dict__", {}).values()
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            value = getattr(obj, name, None)
            if value is not None:
                yield value


def process_resident_bytes(status: Path = Path("/proc/self/status")) -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in bytes, or ``(0, 0)`` without ``/proc``."""
    try:
        lines = status.read_text().splitlines()
    except OSError:
        return 0, 0
    figures = {key: int(value.split()[0]) * 1024 for key, _, value in (line.partition(":") for line in lines)
               if key in ("VmRSS", "VmHWM")}
    return figures.get("VmRSS", 0), figures.get("VmHWM", 0)
