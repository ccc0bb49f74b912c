"""Incremental detokenization: turn a growing sequence of token ids into stable text deltas.

The prefix/read-offset technique (Hugging Face TGI, vLLM): each new token decodes a short
window of recent ids, ``ids[prefix_offset:]``, and emits only what that window adds beyond
``ids[prefix_offset:read_offset]``, whose text was emitted before. When the window's text ends
with U+FFFD, the last token ended inside a multi-byte UTF-8 character (a byte-level BPE token
split an emoji or a CJK character): nothing is emitted and the window grows until the character
is complete.

Why the deltas concatenate to ``decode(all ids)`` exactly: the offsets only move when the window
text ends with a complete character, so every ``prefix_offset`` sits on a character boundary
where a from-scratch decode is in the same state as the full decode; decoding from there gives
the same characters the full decode gives. A genuinely invalid byte (which the full decode also
renders as U+FFFD) is held back like an incomplete one and comes out with the next complete
character, or at :meth:`IncrementalDetokenizer.flush`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

#: What a lossy UTF-8 decode puts where bytes are incomplete or invalid.
REPLACEMENT_CHAR: Final = "\ufffd"


class Decoder(Protocol):
    """The part of the tokenizer the detokenizer uses (``fd_core.model.tokenizer.Tokenizer``)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Per-request detokenizer state; feed ids with :meth:`push`, end with :meth:`flush`.

    Invariant: ``window[:read]`` decodes to exactly ``prefix_len`` characters, all of them
    already emitted; ``window[read:]`` are ids whose text has not been emitted yet.
    """

    tokenizer: Decoder
    skip_special_tokens: bool = True
    window: list[int] = field(default_factory=list)   # ids[prefix_offset:], the decode window
    read: int = 0            # read_offset - prefix_offset: ids before it have been emitted
    prefix_len: int = 0      # characters of decode(window[:read])

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completes ("" while a character is incomplete)."""
        self.window.append(token_id)
        text = self.tokenizer.decode(self.window, skip_special_tokens=self.skip_special_tokens)
        # Nothing new (e.g. a skipped special token), or the last character is still incomplete.
        if len(text) <= self.prefix_len or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Emit whatever is held back, replacement characters included (the request ends)."""
        if self.read == len(self.window):
            return ""
        text = self.tokenizer.decode(self.window, skip_special_tokens=self.skip_special_tokens)
        return self._advance(text) if len(text) > self.prefix_len else ""

    def _advance(self, text: str) -> str:
        """Emit ``text`` past the prefix and slide the window so the ids just emitted are the prefix."""
        delta = text[self.prefix_len:]
        del self.window[:self.read]
        self.read = len(self.window)
        # Decoded again rather than taken as len(delta): decoders such as Metaspace strip the
        # leading space of a window's first token, so the prefix's text may be shorter.
        self.prefix_len = len(self.tokenizer.decode(self.window, skip_special_tokens=self.skip_special_tokens))
        return delta
