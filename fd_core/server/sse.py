"""Server-sent events framing: ``data: <json>\\n\\n`` per event, ending with ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any, Final

#: The last event of every stream, also after an error event.
DONE: Final = b"data: [DONE]\n\n"

#: The media type of an SSE response.
MEDIA_TYPE: Final = "text/event-stream"


def event(data: dict[str, Any]) -> bytes:
    """One SSE event carrying ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
