"""Transparent huge pages for large host buffers that are read in scattered pieces (the KV pool).

Attention reads a row's KV blocks wherever the pool put them: with 4 KiB pages nearly every block
read misses the TLB (a 4 GiB pool spans a million pages). ``madvise(MADV_HUGEPAGE)`` asks Linux to
back the range with 2 MiB pages where the system's THP mode is ``madvise`` (the common default) or
``always``; it must come before the memory is first written. Elsewhere (not Linux, THP compiled
out or ``never``) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14   # <sys/mman.h> on Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def advise_huge_pages(address: int, size: int) -> bool:
    """Ask for huge pages on the whole 2 MiB pages inside ``[address, address + size)``; True when
    Linux took the advice (False: no such page inside, not Linux, or refused)."""
    begin = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    libc = _libc()
    if libc is None or end <= begin:
        return False
    if libc.madvise(begin, end - begin, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True
