"""The hand-off's message kinds and the fields each carries (see :mod:`fd_core.splitwise`).

Every message is a dict with ``kind``; ``id`` is the request id on the decode side and
``attempt`` the decode side's attempt number (echoed back, so late messages of an earlier
attempt are told apart).
"""

from __future__ import annotations

from typing import Final

PREFILL: Final = "prefill"   # decode -> prefill: id, attempt, request (wire.encode_request), layout
BLOCK: Final = "block"       # prefill -> decode: id, attempt, index (position in the request's table); buffers
DONE: Final = "done"         # prefill -> decode: id, attempt, blocks (how many were shipped), token
#                              (wire.token_values), prompt_logprobs (a list of those, or None when not asked)
ACK: Final = "ack"           # decode -> prefill: id, attempt
ABORT: Final = "abort"       # either way: id, attempt, reason
FLUSH: Final = "flush"       # either way, from an instance shutting down after its ABORTs: answer FLUSHED
FLUSHED: Final = "flushed"   # the answer: every message sent before the FLUSH arrived (no fields)
ALIVE: Final = "alive"       # decode -> prefill: open [[id, attempt], ...];
#                              prefill -> decode: open [[id, attempt, done_sent], ...] (done_sent: every
#                              BLOCK and the DONE went, so a DONE that has not arrived was lost)

