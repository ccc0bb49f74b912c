"""Contract of the tool-parser seam: turning a model family's generated text into content and tool calls.

A plugin writes one method, :meth:`ToolParser.scan`: given the text not settled yet and the state
the earlier text left it in, it settles a prefix of that text into pieces: content (``Span``
``"content"``), markup the client never sees (``"markup"``: the family's tags, the whitespace
around a call) and complete calls (:class:`FoundCall`, carrying the exact text it was read from).
The contract derives both ways of parsing from it (``fd_core.text_scan.drain`` asks until nothing
more settles):

* :meth:`ToolParser.parse` — a whole reply -> :class:`ParsedTools` (content and calls);
* :meth:`ToolParser.stream` — a :class:`ToolCallStream` fed text deltas, answering each with a
  :class:`ToolDelta`: content text and the calls completed by it, in the shape of OpenAI's streaming
  ``delta.tool_calls`` (:meth:`ToolCallDelta.to_openai`).

Invariants (``fd_core.testing.conformance.tool_parser`` checks them):

* the pieces cover the text exactly: no character lost or repeated; markup holds only whitespace
  and the parser's :attr:`~ToolParser.markers`;
* a call is settled only once it is complete and valid (its JSON closed and parsed, a name, an
  object of arguments): a call the model never finishes, or whose JSON does not parse, is content,
  verbatim. Nothing sent in a stream is ever taken back, so a stream passes a call on whole, in one
  delta, when it completes;
* streaming in any split of the text gives what parsing the whole text gives.

Tool call ids are ``call_`` and 24 random hex digits (:meth:`ToolParser.new_call_id`; a family
whose templates want another form overrides it), unless the model wrote one or the caller passes a
factory (``new_id=``, e.g. for reproducible tests).

Selection: ``tool_parser.name = "auto"`` (the default) picks the installed parser whose
:meth:`~ToolParser.matches_template` accepts the model's chat template (``fd_core.parser_choice``);
``"none"`` parses no tool calls; a name picks that parser.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fd_core.contracts._base import TemplateParser
from fd_core.text_scan import CONTENT, MARKUP, ScanError, Span, drain, parser_label


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, as OpenAI's ``message.tool_calls[i]`` carries it."""

    id: str          # "call_3f2a..." (or the id the model wrote)
    name: str        # the function's name
    arguments: str   # a JSON object, as text

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A call completed by one delta, at its place among the reply's calls."""

    index: int       # 0 for the reply's first call
    call: ToolCall

    def to_openai(self) -> dict[str, Any]:
        """One entry of a streamed ``delta.tool_calls``: the call with its ``index``."""
        return {"index": self.index, **self.call.to_openai()}


@dataclass(frozen=True, slots=True)
class ParsedTools:
    """A whole reply: the text the client reads, and the calls in the order written."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """What one streamed delta settled: content text and the calls it completed."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class FoundCall:
    """A complete, valid call a scanner read, and the exact text it read it from (its tags and the
    whitespace around it included)."""

    name: str
    arguments: str          # a JSON object, as text
    text: str
    id: str | None = None   # the id the model wrote, if its format has one


@dataclass(frozen=True, slots=True)
class ToolScan:
    """What one :meth:`ToolParser.scan` settled: ``pieces`` cover a prefix of its text, in order."""

    pieces: tuple[Span | FoundCall, ...]   # Span kinds: "content", "markup"
    state: str                             # where the text stands after them


class ToolParser(TemplateParser, ABC):
    """Reads one model family's tool calls out of its generated text (one instance serves every request)."""

    @classmethod
    def conformance_samples(cls) -> tuple[str, ...]:
        """Replies as the family writes them, every feature somewhere (parallel calls, text around
        them, a malformed call): the conformance kit checks streaming against whole parsing on each
        and on every prefix of each (a reply cut short)."""
        return ()

    def initial_state(self) -> str:
        """The state a reply starts in (:meth:`scan`'s ``state``)."""
        return "start"

    @abstractmethod
    def scan(self, text: str, state: str, *, final: bool) -> ToolScan:
        """Settle a prefix of ``text`` (everything not settled yet), read in ``state``.

        Settle only what no later text can change: keep a tag that may be split (``"<tool_"``) or a
        call whose JSON is still open unsettled (return no pieces) until more text comes. With
        ``final`` the reply has ended: settle something (an unfinished call becomes content). It may
        settle less than it could; it is called again with the rest.
        """

    def new_call_id(self) -> str:
        """A fresh tool call id: ``call_`` and 24 random hex digits."""
        return f"call_{secrets.token_hex(12)}"

    def parse(self, text: str, *, new_id: Callable[[], str] | None = None) -> ParsedTools:
        """Content and calls of a whole reply; ``new_id`` makes the ids of calls the model gave none."""
        stream = self.stream(new_id=new_id)
        deltas = (stream.feed(text), stream.finish())
        return ParsedTools("".join(delta.content for delta in deltas),
                           tuple(call.call for delta in deltas for call in delta.tool_calls))

    def stream(self, *, new_id: Callable[[], str] | None = None) -> ToolCallStream:
        """A parser of one streamed reply, fed its text deltas in order."""
        return ToolCallStream(self, new_id or self.new_call_id)


class ToolCallStream:
    """One reply's streaming parse: :meth:`feed` each text delta, then :meth:`finish` once."""

    def __init__(self, parser: ToolParser, new_id: Callable[[], str]) -> None:
        self._parser = parser
        self._new_id = new_id
        self._pending = ""                     # text received and not settled yet
        self._state = parser.initial_state()
        self._calls = 0                        # calls passed on so far: the next one's index

    def feed(self, text: str) -> ToolDelta:
        """Take the next delta of the reply; return the content and calls it settled."""
        return self._settle(self._pending + text, final=False)

    def finish(self) -> ToolDelta:
        """The reply ended: settle what was held back (an unfinished call becomes content)."""
        return self._settle(self._pending, final=True)

    def _settle(self, text: str, *, final: bool) -> ToolDelta:
        who = parser_label("tool parser", self._parser)
        pieces, self._pending, self._state = drain(self._parser.scan, text, self._state, final=final, who=who)
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, FoundCall):
                call = ToolCall(piece.id or self._new_id(), piece.name, piece.arguments)
                calls.append(ToolCallDelta(self._calls, call))
                self._calls += 1
            elif piece.kind == CONTENT:
                content.append(piece.text)
            elif piece.kind != MARKUP:
                raise ScanError(f"{who}: a span of kind {piece.kind!r}; a tool parser's are "
                                 f"{CONTENT!r} and {MARKUP!r}")
        return ToolDelta("".join(content), tuple(calls))
