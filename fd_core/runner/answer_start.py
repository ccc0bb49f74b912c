"""Where a reasoning reply's answer starts: its reasoning tags found in the bytes of its tokens.

A constraint whose :class:`~fd_core.request.GuidedDecoding` names ``reasoning_end`` applies to the
answer after the reasoning (``fd_core.runner.constraints``). :class:`ReplyScan` reads one reply's
output tokens in order and says which phase the reply is in:

- ``opening`` (only with ``reasoning_start``): the reply's text so far is a proper prefix of the
  start tag. The next token may be one the constraint allows (the reply answers at once) or one
  that continues the tag (:attr:`ReasoningTags.opening`); once a token leaves the tag, the reply
  is an answer from its first token, and once the tag is complete, it reasons;
- ``reasoning``: no constraint, until the text first holds the end tag;
- ``answer``: the constraint applies, from the token after the one that completed the end tag.

Tags are matched in the tokens' bytes (``Tokenizer.token_bytes``), so a tag that is one added token
(Qwen3's ``</think>``) and a tag written in pieces (``"</"``, ``"think"``, ``">"``) are found
alike. The answer starts at a token boundary: while the reply reasons, a token that would complete
the end tag and carry more text (``">{"``) is masked (:attr:`ReasoningTags.overshooting`), so no
part of the answer escapes its constraint.

The scan keeps no text: of the end tag, only how many bytes of its start end the text so far (the
longest such prefix: a match can start nowhere earlier), so a step reads the bytes of one token.
A scan rebuilt from a request's ``output_token_ids`` (a continuation, a preempted request) reaches
the same phase at the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

OPENING: Final = "opening"
REASONING: Final = "reasoning"
ANSWER: Final = "answer"


class ReasoningTags:
    """One pair of tags over one vocabulary: the token sets the phases need, built once and shared.

    ``token_bytes[i]`` is token ``i``'s bytes in decoded text (ids past its end have none).
    """

    def __init__(self, start: str | None, end: str, token_bytes: Sequence[bytes]) -> None:
        self.start = None if start is None else start.encode()
        self.end = end.encode()
        self.token_bytes = token_bytes
        #: ``overshooting[p]``: token ids that, read after ``p`` bytes of the end tag, complete it
        #: before their last byte (masked while reasoning: the answer starts at a token boundary).
        self.overshooting = self._overshooting()
        #: ``opening[n]``: token ids that continue the start tag after ``n`` of its bytes, or complete
        #: it (but not those that go on to end the end tag before their last byte).
        self.opening = [] if self.start is None else self._opening(self.start)

    def bytes_of(self, token_id: int) -> bytes:
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""

    def read_end(self, partial: int, data: bytes) -> tuple[int, bool]:
        """Read ``data`` with the text so far ending in ``partial`` bytes of the end tag: the new
        partial length, and whether the text now holds the tag."""
        text = self.end[:partial] + data
        if self.end in text:
            return 0, True
        for keep in range(min(len(self.end) - 1, len(text)), 0, -1):
            if text.endswith(self.end[:keep]):
                return keep, False
        return 0, False

    def _overshoots(self, partial: int, data: bytes) -> bool:
        text = self.end[:partial] + data
        found = text.find(self.end)
        return found >= 0 and found + len(self.end) < len(text)

    def _overshooting(self) -> list[np.ndarray]:
        last = self.end[-1:]
        # only a token holding the tag's last byte before its own last byte can complete it early
        candidates = [i for i, data in enumerate(self.token_bytes) if last in data[:-1]]
        return [np.array([i for i in candidates if self._overshoots(partial, self.token_bytes[i])], dtype=np.int64)
                for partial in range(len(self.end))]

    def _opening(self, start: bytes) -> list[np.ndarray]:
        starting: dict[int, list[int]] = {byte: [] for byte in start}   # first byte -> the tokens beginning with it
        for i, data in enumerate(self.token_bytes):
            if data and data[0] in starting:
                starting[data[0]].append(i)
        tables = []
        for done in range(len(start)):
            rest = start[done:]
            tables.append(np.array([i for i in starting[rest[0]] if rest.startswith(self.token_bytes[i]) or (
                self.token_bytes[i].startswith(rest) and not self._overshoots(0, self.token_bytes[i][len(rest):]))],
                dtype=np.int64))
        return tables


@dataclass(slots=True)
class ReplyScan:
    """One reply's phase (see the module docstring), advanced one output token at a time."""

    tags: ReasoningTags
    phase: str
    partial: int = 0   # opening: bytes of the start tag written; reasoning: bytes of the end tag that end the text

    @classmethod
    def begin(cls, tags: ReasoningTags) -> ReplyScan:
        """The scan of a reply not started yet: opening with a start tag, else reasoning."""
        return cls(tags, OPENING if tags.start is not None else REASONING)

    def read(self, token_id: int) -> None:
        """Take the reply's next token (before its answer: the answer's tokens are the matcher's)."""
        assert self.phase != ANSWER
        data = self.tags.bytes_of(token_id)
        if self.phase == OPENING:
            assert self.tags.start is not None
            rest = self.tags.start[self.partial:]
            if len(data) < len(rest) and rest.startswith(data):
                self.partial += len(data)
                return
            if not data.startswith(rest):
                self.phase = ANSWER   # the reply left the start tag: all of it is the answer
                return
            self.phase, self.partial, data = REASONING, 0, data[len(rest):]
        self.partial, ended = self.tags.read_end(self.partial, data)
        if ended:
            self.phase = ANSWER

    def tag_tokens(self) -> np.ndarray:
        """Opening: the token ids that continue the start tag (allowed beside the constraint's)."""
        assert self.phase == OPENING
        return self.tags.opening[self.partial]

    def overshooting(self) -> np.ndarray:
        """Reasoning: the token ids to mask (they would end the tag in their middle)."""
        assert self.phase == REASONING
        return self.tags.overshooting[self.partial]
