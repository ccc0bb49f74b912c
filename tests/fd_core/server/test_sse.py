"""SSE framing: every event is one line of JSON, whatever characters the text holds."""

from __future__ import annotations

import json

from fd_core.server.sse import event

#: Characters that ``str.splitlines`` takes for line ends, beside the JSON-escaped \n and \r.
LINE_ENDS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_an_event_is_one_line_that_decodes_to_the_same_text() -> None:
    text = f"a{LINE_ENDS}b\n\r\u00e9\u4e2d"
    frame = event({"choices": [{"text": text}]})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    line = frame[len(b"data: "):-2].decode()
    assert line.splitlines() == [line]
    assert json.loads(line) == {"choices": [{"text": text}]}
    assert "\u00e9\u4e2d" in line   # other non-ASCII text stays as UTF-8, not escapes
