"""Server-sent events framing: ``data: <json>\\n\\n`` per event, ending with ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any, Final

#: The last event of every stream, also after an error event.
DONE: Final = b"data: [DONE]\n\n"

#: The media type of an SSE response.
MEDIA_TYPE: Final = "text/event-stream"


#: Characters JSON may leave raw that ``str.splitlines`` (and clients splitting a stream that way)
#: takes for line ends: written as ``\uXXXX`` escapes, the same JSON value.
_LINE_BREAKS: Final = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(data: dict[str, Any]) -> bytes:
    """One SSE event carrying ``data`` as compact JSON on one line, whatever text it holds."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"
