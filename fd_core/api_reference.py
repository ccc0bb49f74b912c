"""The API reference of ``fd_core``'s public surface (its ``__all__``), from the code itself.

``python -m fd_core.api_reference > docs/api.md`` regenerates ``docs/api.md``; a test fails when
the committed file differs. Per name: its kind, signature and docstring; per class, its public
methods and properties (those defined in fd_core) with their signatures and first docstring
paragraph. An object made by another library (``hookimpl`` is a ``pluggy.HookimplMarker``) is
named by that library's public name only: its signature and docstring belong to the library and
change with its releases, which would make this file depend on the installed version.
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
from collections.abc import Iterator
from typing import Any

import fd_core


def _first_paragraph(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring (not one inherited from ``object``)."""
    doc = inspect.cleandoc(getattr(obj, "__doc__", None) or "")
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def _signature(obj: Any) -> str:
    """The signature, with object addresses in default values' reprs left out (stable output)."""
    try:
        return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return ""


def _members(cls: type) -> Iterator[str]:
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property):
            yield f"- `{name}` (property): {_first_paragraph(member)}"
        elif isinstance(member, (classmethod, staticmethod)):
            yield f"- `{name}{_signature(member.__func__)}`: {_first_paragraph(member.__func__)}"
        elif inspect.isfunction(member):
            doc = _first_paragraph(member)
            yield f"- `{name}{_signature(member)}`" + (f": {doc}" if doc else "")


def _public_name(cls: type) -> str:
    """``package.Name`` when the class's top-level package exports it under that name (pluggy's
    ``HookimplMarker`` lives in a private module that moved in pluggy 1.7), else its full path."""
    top = cls.__module__.split(".", 1)[0]
    if getattr(sys.modules.get(top), cls.__qualname__, None) is cls:
        return f"{top}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_foreign(obj: Any) -> bool:
    """True for an instance of another library's class (not a class, function or plain value)."""
    if inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, (int, float, str, bool, type(None))):
        return False
    return not type(obj).__module__.startswith("fd_core")


def _entry(name: str, obj: Any) -> list[str]:
    where = getattr(obj, "__module__", None) or ""
    if _is_foreign(obj):
        public = _public_name(type(obj))
        return [f"### `{name}` (`{public}` instance, `{fd_core._EXPORTS[name]}`)", "",
                f"Made by another library: `{public}`'s own documentation says how it is called.", ""]
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        values = ", ".join(f"`{m.value}`" for m in obj)
        return [f"### `{name}` (enum, `{where}`)", "", _first_paragraph(obj), "", f"Values: {values}.", ""]
    if inspect.isclass(obj):
        bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
        lines = [f"### `{name}` (class{f' of {bases}' if bases else ''}, `{where}`)", "",
                 (inspect.getdoc(obj) or "").strip(), ""]
        members = list(_members(obj))
        return lines + (members + [""] if members else [])
    if callable(obj):
        return [f"### `{name}{_signature(obj)}` (`{where}`)", "", (inspect.getdoc(obj) or "").strip(), ""]
    return [f"### `{name}` = `{obj!r}`", ""]


def render() -> str:
    """The whole reference as markdown."""
    lines = ["# `fd_core` API reference", "",
             "Generated from the code by `python -m fd_core.api_reference > docs/api.md`: every name in",
             "`fd_core.__all__` (importable as `from fd_core import NAME`). The seam guides in `docs/seams/`",
             "explain how the pieces fit.", ""]
    for name in fd_core.__all__:
        if name == "__version__":
            continue
        lines += _entry(name, getattr(fd_core, name))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
