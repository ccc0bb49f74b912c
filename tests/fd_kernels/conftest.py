"""Fixtures of the kernel tests: the C++ kernels built for this host, skipped without a compiler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fd_kernels import native
from fd_plugins.platforms.cpu import CpuPlatform


def _prepared(prepare: Callable[[Any], Any]) -> Any:
    """``prepare`` of this host's declared capabilities; skips without a C++ compiler, raises on a failed build."""
    try:
        return prepare(CpuPlatform().capabilities)
    except native.NativeKernelsUnavailable as exc:
        if "no C++ compiler" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="session")
def prepared() -> Callable[[Callable[[Any], Any]], Any]:
    """:func:`_prepared`, for module fixtures that prepare several kernels."""
    return _prepared


@pytest.fixture(scope="module")
def linear():
    """The C++ linear kernel (MKL packed, bfloat16 panels, blocks, int8) for this host."""
    return _prepared(native.prepare_linear)
