"""The engine process's host memory: glibc, when it is the C library, and giving freed memory back.

A model loads on the host (reading, dequantizing, converting) before its weights are packed for
the kernels; once packed, the load-time arrays are garbage. Platforms may tune glibc's malloc to
keep freed memory in the heap for the next step (the cpu platform does, before the model loads),
and then that garbage stays resident for the life of the process: ~680 MiB for the default model.
:func:`release_freed_memory` hands it back once, when the model is built and before the KV pool is
allocated (so the pool never sits beside the load-time arrays).
"""

from __future__ import annotations

import ctypes


def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim(0)``, which also
    releases free pages inside the heap); True when some were. Without glibc, nothing happens."""
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0))
