"""Keep the host allocator from handing a step's buffers back to the kernel after every step.

glibc's malloc serves each allocation above its mmap threshold (128 KiB at first, adapting up to
32 MiB) with a fresh ``mmap`` and unmaps it on free; it also trims the heap's free top. A model
step allocates tens of MiB of activations and frees them again, so every step faulted its pages
in anew: ~490k minor faults and over half the time of a 128-row decode step on 2 cores. Turning
both off (``mallopt``) keeps freed memory in the heap, where the next step reuses it already
mapped; the process's resident size settles at its largest step instead. This is done in the
engine's own process, so nothing has to be exported or preloaded; allocators that are not
glibc's (tcmalloc, jemalloc preloaded by the user) are left alone. The load-time garbage this
would keep too is given back once, after loading (``fd_core.host_memory``).
"""

from __future__ import annotations

from typing import Final

from fd_core.host_memory import glibc

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD: Final = -1
_M_TOP_PAD: Final = -2
_M_MMAP_MAX: Final = -4
#: Largest trim threshold mallopt takes (an int): freed heap memory is never given back.
_NEVER_TRIM: Final = 2**31 - 1
#: Extra heap grown per request, so a growing step maps its pages in fewer, larger steps.
_TOP_PAD_BYTES: Final = 64 << 20


def keep_freed_memory() -> str:
    """Tune glibc's malloc as the module docstring says; returns what was done, for the log."""
    libc = glibc()
    if libc is None:
        return "allocator left as is (not glibc)"
    preloaded = _preloaded_allocator()
    if preloaded:
        return f"allocator left as is ({preloaded} is preloaded)"
    ok = (libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
          and libc.mallopt(_M_TOP_PAD, _TOP_PAD_BYTES) == 1)
    if not ok:
        return "allocator left as is (mallopt refused)"
    return "glibc malloc keeps freed memory (no mmap per buffer, no trim)"


def _preloaded_allocator() -> str | None:
    """The name of an allocator library mapped into this process, if one is (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                for name in ("tcmalloc", "jemalloc", "mimalloc"):
                    if name in line:
                        return name
    except OSError:
        return None
    return None
