"""Contain misbehaving plugins: report each failure once, naming the plugin, and carry on.

:class:`GuardedHooks` is the one way fd-engine calls a hook (the engine core's lifecycle hooks,
the seams' decision hooks); the engine core also uses :class:`FailureReporter` for the seam
calls that end a request. A failure is logged as a :class:`~fd_core.errors.PluginError` naming
the plugin and the hook or method, once per pair (a plugin that fails on every step would
otherwise flood the log), and the caller goes on: with the next implementation, and in the end
with its default.

Implementations are called one at a time, in pluggy's own order (last registered first,
``tryfirst``/``trylast`` honoured), so that one that raises cannot hide the others or the
engine's own work (pluggy's ``hook.name(...)`` stops at the first exception and raises it into
the caller). Hook wrappers are not called: they wrap a call that no longer exists as one.
The engine loop therefore never retries a failing hook in a tight loop, and a request is never
stranded by one.
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

    def report(self, plugin: str, where: str, what: str, *,
               fallback: str = "the default was used instead") -> None:
        """Log ``plugin``'s failure in ``where`` (a hook or method name) unless already logged;
        ``fallback`` says what the caller did instead."""
        if (plugin, where) in self._reported:
            return
        self._reported.add((plugin, where))
        log.error("%s", PluginError(plugin, f"{where} {what}; {fallback} "
                                            "(reported once; later failures here are not logged)"))


class GuardedHooks:
    """Guarded calls of fd hooks over a pluggy hook relay (``registry.hooks``; ``None``: no plugins).

    Three kinds of call: :meth:`notify` (lifecycle: every implementation is told),
    :meth:`decide` (firstresult decisions: the first usable answer wins) and :meth:`refusal`
    (``fd_request_added``: an implementation may refuse the request on purpose by raising).
    """

    def __init__(self, hooks: Any) -> None:
        self._hooks = hooks
        self._reporter = FailureReporter()

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call every implementation; one that raises is reported and the rest are still called."""
        for impl in self._implementations(hook_name):
            try:
                impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception as exc:  # a plugin bug; KeyboardInterrupt and SystemExit pass
                self._reporter.report(impl.plugin_name, f"hook {hook_name}", f"raised {type(exc).__name__}: {exc}",
                                      fallback="the other implementations were still called")

    def decide(self, hook_name: str, check: AnswerCheck, **kwargs: Any) -> Any:
        """The first usable non-``None`` answer, or ``None`` (the caller's default applies).

        An implementation that raises, or whose answer ``check`` rejects, is reported and
        skipped: the next one is asked."""
        for impl in self._implementations(hook_name):
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

    def refusal(self, hook_name: str, **kwargs: Any) -> str | None:
        """Call the implementations in order until one raises: that one refuses (on purpose, so
        it is not logged as a failure) and the rest are not called. Returns ``"plugin <name>:
        <error>"`` for the request's error, or ``None`` when every implementation accepted."""
        for impl in self._implementations(hook_name):
            try:
                impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception as exc:
                return f"plugin {impl.plugin_name}: {exc}"
        return None

    def _implementations(self, hook_name: str) -> list[Any]:
        if self._hooks is None:
            return []
        return [impl for impl in reversed(getattr(self._hooks, hook_name).get_hookimpls())
                if not (impl.hookwrapper or impl.wrapper)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
