"""Reading one tool call out of the JSON a model wrote for it."""

from __future__ import annotations

import json
from typing import Any


def decode(text: str) -> Any:
    """The JSON value ``text`` holds (whitespace around it allowed), or None when it holds none."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def read_call(value: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a decoded call, or None when ``value`` is not one.

    A call is an object with a non-empty string ``name`` and its arguments under the first of
    ``argument_keys`` present: an object, or a JSON string holding one (as OpenAI's own messages
    carry them). No arguments key means no arguments (``{}``).
    """
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):
        arguments = decode(arguments)
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)
