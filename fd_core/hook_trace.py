"""Hook tracing (``plugins.trace_hooks``): calls, errors and time per hook implementation.

:meth:`HookTracer.install` wraps the function of every registered implementation of every
fd hook (hook wrappers excepted: they make no decision), so both pluggy's own calls and
:class:`~fd_core.plugin_guard.GuardedHooks`' one-by-one calls are counted. The engine exports
:meth:`HookTracer.snapshot` in ``/metrics`` as ``fd_hook_calls_total``, ``fd_hook_errors_total``
and ``fd_hook_seconds_total`` with the labels ``hook`` and ``plugin``. Install it last, once
every plugin is registered; the cost is two clock reads and a lock per call.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pluggy

from fd_core.seams import SEAMS

#: Registration hooks run once, at discovery, before tracing can start: not traced.
_NOT_TRACED = frozenset(seam.registration_hook for seam in SEAMS)


class HookTracer:
    """Per (hook, plugin): calls, errors (calls that raised) and seconds spent."""

    def __init__(self) -> None:
        self._figures: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()

    def install(self, plugin_manager: pluggy.PluginManager) -> None:
        """Wrap every implementation registered now (each once)."""
        for hook_name, caller in vars(plugin_manager.hook).items():
            if hook_name in _NOT_TRACED or not isinstance(caller, pluggy.HookCaller):
                continue
            for impl in caller.get_hookimpls():
                if impl.hookwrapper or impl.wrapper or getattr(impl.function, "_fd_traced", False):
                    continue
                key = (hook_name, impl.plugin_name)
                self._figures.setdefault(key, [0, 0, 0.0])
                impl.function = self._traced(impl.function, key)

    def snapshot(self) -> list[dict[str, Any]]:
        """One dict per implementation: hook, plugin, calls, errors, seconds."""
        with self._lock:
            return [{"hook": hook, "plugin": plugin, "calls": int(calls), "errors": int(errors), "seconds": seconds}
                    for (hook, plugin), (calls, errors, seconds) in sorted(self._figures.items())]

    def _traced(self, function: Callable[..., Any], key: tuple[str, str]) -> Callable[..., Any]:
        figures = self._figures[key]
        lock = self._lock

        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            failed = True
            try:
                result = function(*args, **kwargs)
                failed = False
                return result
            finally:
                elapsed = time.perf_counter() - begin
                with lock:
                    figures[0] += 1
                    figures[1] += failed
                    figures[2] += elapsed

        traced._fd_traced = True  # type: ignore[attr-defined]
        return traced
