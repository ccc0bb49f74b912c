"""How a kit turns a plugin class and its options into the factory it drives, and names it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def plugin_settings(cls: type, options: Mapping[str, Any] | None) -> Any:
    """``cls.settings_model`` validated from ``options`` (``{}`` when None); None for a plugin without one.

    Raises pydantic's ValidationError for bad options, ValueError for options given to a plugin
    that takes none.
    """
    model = cls.settings_model  # type: ignore[attr-defined]
    if model is None:
        if options:
            raise ValueError(f"{cls.__name__} takes no options, got {sorted(options)}")
        return None
    return model.model_validate(dict(options or {}))


def describe(plugin: object) -> str:
    """How a report names what it checked: the class name, or the factory's qualified name."""
    if isinstance(plugin, type):
        return plugin.__name__
    return getattr(plugin, "__qualname__", type(plugin).__name__)


@dataclass(slots=True)
class ThreadCall(Generic[T]):
    """``fn()`` run on its own daemon thread; :meth:`join` says whether it returned in time."""

    fn: Callable[[], T]
    value: T | None = None
    error: BaseException | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self) -> ThreadCall[T]:
        self._thread = threading.Thread(target=self._run, name="fd-conformance-call", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """True when ``fn`` returned (or raised) within ``timeout`` seconds; re-raises its error."""
        if not self._done.wait(timeout):
            return False
        if self.error is not None:
            raise self.error
        return True

    def _run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the thread that joins
            self.error = exc
        finally:
            self._done.set()
