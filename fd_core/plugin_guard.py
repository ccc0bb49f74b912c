"""Contain misbehaving plugins: report each failure once, naming the plugin, and carry on.

Two users: :class:`DecisionHooks` for the firstresult decision hooks (``fd_order_waiting``,
``fd_select_preemption_victim``, ``fd_prefill_chunk_size``), and the engine core for the
seam calls that end a request. A failure is logged as a :class:`~fd_core.errors.PluginError`
naming the plugin and the hook or method, once per pair (a plugin that fails on every step
would otherwise flood the log), and the caller falls back to its default for that call.

:class:`DecisionHooks` asks the implementations in pluggy's own order, one at a time, so that it
knows who answered: an implementation that raises, or whose answer the caller's ``check``
rejects, is skipped (the next one is asked, and in the end the caller's default applies).
Hook wrappers make no decision and are not called. The engine loop therefore never retries a
failing hook in a tight loop, and a request is never stranded by one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fd_core.errors import PluginError

log = logging.getLogger(__name__)

#: ``check(answer) -> None`` if the answer is usable, else why not (one phrase).
AnswerCheck = Callable[[Any], "str | None"]


def plugin_label(plugin: object) -> str:
    """How errors name a seam plugin instance: ``name (module:Class)``."""
    cls = type(plugin)
    return f"{cls.name} ({cls.__module__}:{cls.__qualname__})"  # type: ignore[attr-defined]


class FailureReporter:
    """Logs a plugin failure once per (plugin, hook or method)."""

    def __init__(self) -> None:
        self._reported: set[tuple[str, str]] = set()

    def report(self, plugin: str, where: str, what: str) -> None:
        """Log ``plugin``'s failure in ``where`` (a hook or method name) unless already logged."""
        if (plugin, where) in self._reported:
            return
        self._reported.add((plugin, where))
        log.error("%s", PluginError(plugin, f"{where} {what}; the default was used instead "
                                            "(reported once; later failures here are not logged)"))


class DecisionHooks:
    """Guarded calls of firstresult hooks over a pluggy hook relay (``registry.hooks``)."""

    def __init__(self, hooks: Any) -> None:
        self._hooks = hooks
        self._reporter = FailureReporter()

    def call(self, hook_name: str, check: AnswerCheck, **kwargs: Any) -> Any:
        """The first usable non-``None`` answer, or ``None`` (the caller's default applies)."""
        if self._hooks is None:
            return None
        for impl in reversed(getattr(self._hooks, hook_name).get_hookimpls()):
            if impl.hookwrapper or impl.wrapper:
                continue
            try:
                answer = impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception as exc:  # a plugin bug; KeyboardInterrupt and SystemExit pass
                self._reporter.report(impl.plugin_name, f"hook {hook_name}", f"raised {type(exc).__name__}: {exc}")
                continue
            if answer is None:
                continue
            problem = check(answer)
            if problem is None:
                return answer
            self._reporter.report(impl.plugin_name, f"hook {hook_name}", f"returned {_short(answer)}, which {problem}")
        return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
