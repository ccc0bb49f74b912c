"""Build (once) and load fd-engine's C++ CPU kernels, as Paddle custom ops.

The sources in ``csrc/`` are compiled with ``paddle.utils.cpp_extension.load`` into a folder
keyed by the Paddle version, the ISA flags and a hash of the sources
(``$FD_CACHE_DIR/kernels/<key>``, default ``~/.cache/fd-engine/kernels``), so a later start
loads the built library in well under a second, and a cache shared by machines with different
CPUs never hands one a library built for another. The ISA flags come from the capabilities the
platform declared (``-mavx512f ...`` only where it declared ``avx512f``), never ``-march=native``.
Builds from several processes at once (data-parallel ranks) are serialised by a file lock.

:func:`load_native` raises :class:`NativeKernelsUnavailable` with the reason (no compiler, the
build failed); the kernel table then falls back to the Paddle reference kernels and says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from types import ModuleType
from typing import Any, Final

log = logging.getLogger(__name__)

SOURCES: Final = (Path(__file__).parent / "csrc" / "paged_decode_attention.cc",)
_BASE_FLAGS: Final = ("-O3", "-fopenmp-simd", "-std=c++17")
_loaded: dict[str, ModuleType] = {}


class NativeKernelsUnavailable(Exception):
    """The C++ kernels cannot be used here; the message says why."""


def isa_flags(capabilities: Collection[str]) -> tuple[str, ...]:
    """Compiler flags for the declared ISA features (baseline x86-64 when none)."""
    declared = set(capabilities)
    if {"avx512f", "avx2", "fma"} <= declared:   # only F: the probe does not declare dq/bw/vl
        return ("-mavx2", "-mfma", "-mavx512f")
    if {"avx2", "fma"} <= declared:
        return ("-mavx2", "-mfma")
    return ()


def cache_dir(flags: tuple[str, ...]) -> Path:
    """Where the library built with ``flags`` lives (see the module docstring)."""
    import paddle

    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join(_BASE_FLAGS + flags).encode())
    isa = "-".join(flag.removeprefix("-m") for flag in flags) or "baseline"
    root = os.environ.get("FD_CACHE_DIR")
    base = (Path(root) if root else Path.home() / ".cache" / "fd-engine") / "kernels"
    return base / f"paddle{paddle.__version__}-{isa}-{digest.hexdigest()[:12]}"


def load_native(capabilities: Collection[str]) -> ModuleType:
    """The ops module (``fd_paged_decode_attention``) built for ``capabilities``; builds on first use."""
    flags = isa_flags(capabilities)
    folder = cache_dir(flags)
    key = str(folder)
    if key in _loaded:
        return _loaded[key]
    if _loaded:   # Paddle registers an op name once per process
        raise NativeKernelsUnavailable(f"this process already loaded the C++ kernels built as {next(iter(_loaded))}")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise NativeKernelsUnavailable("no C++ compiler on PATH (install g++ to build the C++ kernels)")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another process may be building the same library
        try:
            module = _build(folder, flags)
        except Exception as exc:   # a compiler or ABI failure: the reference kernels still work
            raise NativeKernelsUnavailable(f"building {folder.name} failed: {type(exc).__name__}: "
                                           f"{str(exc).strip()[-400:]}") from exc
    _loaded[key] = module
    return module


def prepare_decode_attention(capabilities: Collection[str]) -> Callable[..., Any]:
    """The C++ ``decode_attention`` kernel variant (reads the KV blocks in place), built for
    ``capabilities``; raises :class:`NativeKernelsUnavailable`. Uses the CPUs this process may
    run on (a data-parallel rank's share)."""
    op = load_native(capabilities).fd_paged_decode_attention
    threads = len(os.sched_getaffinity(0))

    def decode_attention_cpp(q: Any, k_cache: Any, v_cache: Any, attn: Any, scale: float) -> Any:
        return op(q.contiguous(), k_cache, v_cache, attn.decode_tables, attn.decode_lens, scale, threads)

    return decode_attention_cpp


def _build(folder: Path, flags: tuple[str, ...]) -> ModuleType:
    if not any(folder.glob("**/*.so")):
        log.info("building the C++ kernels into %s (once per Paddle version, ISA and source)", folder)
    saved = os.dup(1), os.dup(2)
    # Paddle's build prints compiler lines and warnings on stdout/stderr: they go to build.log
    with open(folder / "build.log", "a") as build_log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(build_log.fileno(), 1)
        os.dup2(build_log.fileno(), 2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # e.g. "No ccache found"
                from paddle.utils.cpp_extension import load

                return load(name="fd_native_kernels", sources=[str(s) for s in SOURCES],
                            extra_cxx_cflags=[*_BASE_FLAGS, *flags], build_directory=str(folder), verbose=False)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
