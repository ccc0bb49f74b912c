"""Contract of the reasoning-parser seam: splitting a reasoning model's text into its reasoning and its answer.

A plugin writes one method, :meth:`ReasoningParser.scan`: given the text not settled yet and the
state the earlier text left it in, it settles a prefix of that text into spans of kind
``"reasoning"`` (OpenAI-style ``reasoning_content``), ``"content"`` (the answer) and ``"markup"``
(the family's tags and the whitespace next to them, which the client never sees). The contract
derives both ways of parsing from it (``fd_core.text_scan.drain`` asks until nothing more settles):

* :meth:`ReasoningParser.parse` — a whole reply -> :class:`ReasoningText`;
* :meth:`ReasoningParser.stream` — a :class:`ReasoningStream` fed text deltas, answering each with
  the reasoning and content text it settled (``delta.reasoning_content`` / ``delta.content``).

Where a reply starts: some chat templates open the reasoning in the prompt (``<think>\\n`` at the
end of it), so the reply starts inside the reasoning and only its closing tag appears. Both ways
take the prompt the reply continues; :meth:`ReasoningParser.initial_state` reads it.

A constraint (``response_format``, ``guided_*``, ``tool_choice`` required) is on the answer, not on
the reasoning: :meth:`ReasoningParser.reply_reasoning` tells the server, for a prompt, which tags
bound a reply's reasoning, and the engine applies the constraint from the first token after the end
tag (``GuidedDecoding.reasoning_end``). A parser that does not say (the default) has its replies
constrained from their first token.

Invariants (``fd_core.testing.conformance.reasoning_parser`` checks them): the spans cover the text
exactly, markup holding only whitespace and the parser's :attr:`~ReasoningParser.markers`; a tag
split across deltas (``"</th"``, ``"ink>"``) is held back until it is known; streaming in any split
gives what parsing the whole text gives.

Selection: ``reasoning_parser.name = "auto"`` (the default) picks the installed parser whose
:meth:`~ReasoningParser.matches_template` accepts the model's chat template
(``fd_core.parser_choice``); ``"none"`` leaves all text in the content; a name picks that parser.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from fd_core.contracts._base import TemplateParser
from fd_core.text_scan import CONTENT, MARKUP, REASONING, ScanError, Span, drain, parser_label


@dataclass(frozen=True, slots=True)
class ReasoningText:
    """A reply, or one streamed delta of it, split into reasoning and answer."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True, slots=True)
class ReplyReasoning:
    """How a reply to one prompt may reason before its answer: the tags a constraint on the answer waits for."""

    end: str                   # the text that ends the reasoning; the answer follows it
    start: str | None = None   # None: the reply starts inside its reasoning (the prompt opened it);
    #                            a text: the reply reasons only if it begins with it, else it is all answer


@dataclass(frozen=True, slots=True)
class ReasoningScan:
    """What one :meth:`ReasoningParser.scan` settled: ``pieces`` cover a prefix of its text, in order."""

    pieces: tuple[Span, ...]   # kinds "reasoning", "content", "markup"
    state: str                 # where the text stands after them


class ReasoningParser(TemplateParser, ABC):
    """Splits one model family's replies into reasoning and answer (one instance serves every request)."""

    @classmethod
    def conformance_samples(cls) -> tuple[tuple[str, str], ...]:
        """``(prompt, reply)`` pairs as the family writes them, every feature somewhere (reasoning
        opened by the prompt, no reasoning at all): the conformance kit checks streaming against
        whole parsing on each and on every prefix of each reply (a reply cut short)."""
        return ()

    def initial_state(self, prompt: str) -> str:
        """The state a reply to ``prompt`` (the rendered chat template) starts in."""
        return "start"

    def reply_reasoning(self, prompt: str) -> ReplyReasoning | None:
        """How a reply to ``prompt`` may reason before its answer; None when it has no reasoning (the
        prompt closed it: Qwen3's ``enable_thinking=False``) or the parser cannot say.

        The server calls it for a chat request that carries a constraint, and the engine then applies
        the constraint from the first token after the output's text first holds ``end`` (with
        ``start``: only if the reply begins with ``start``; a reply that begins otherwise is
        constrained from its first token). Parsing must agree: the text after the first ``end`` of a
        reply that reasons, and the whole of a reply that does not, are its answer, verbatim but for
        whitespace next to a tag (the conformance kit checks it). Both tags are among :attr:`markers`.
        Default: None (replies are constrained from their first token).
        """
        return None

    @abstractmethod
    def scan(self, text: str, state: str, *, final: bool) -> ReasoningScan:
        """Settle a prefix of ``text`` (everything not settled yet), read in ``state``.

        Settle only what no later text can change: keep a tag that may be split (``"</th"``), or
        whitespace that may turn out to sit next to a tag, unsettled (return no pieces) until more
        text comes. With ``final`` the reply has ended: settle something. It may settle less than it
        could; it is called again with the rest.
        """

    def parse(self, text: str, *, prompt: str = "") -> ReasoningText:
        """The reasoning and the answer of a whole reply to ``prompt``."""
        stream = self.stream(prompt=prompt)
        deltas = (stream.feed(text), stream.finish())
        return ReasoningText("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))

    def stream(self, *, prompt: str = "") -> ReasoningStream:
        """A parser of one streamed reply to ``prompt``, fed its text deltas in order."""
        return ReasoningStream(self, self.initial_state(prompt))


class ReasoningStream:
    """One reply's streaming split: :meth:`feed` each text delta, then :meth:`finish` once."""

    def __init__(self, parser: ReasoningParser, state: str) -> None:
        self._parser = parser
        self._pending = ""   # text received and not settled yet
        self._state = state

    def feed(self, text: str) -> ReasoningText:
        """Take the next delta of the reply; return the reasoning and content it settled."""
        return self._settle(self._pending + text, final=False)

    def finish(self) -> ReasoningText:
        """The reply ended: settle what was held back."""
        return self._settle(self._pending, final=True)

    def _settle(self, text: str, *, final: bool) -> ReasoningText:
        who = parser_label("reasoning parser", self._parser)
        pieces, self._pending, self._state = drain(self._parser.scan, text, self._state, final=final, who=who)
        parts: dict[str, list[str]] = {REASONING: [], CONTENT: [], MARKUP: []}
        for piece in pieces:
            if piece.kind not in parts:
                raise ScanError(f"{who}: a span of kind {piece.kind!r}; a reasoning parser's are {sorted(parts)}")
            parts[piece.kind].append(piece.text)
        return ReasoningText("".join(parts[REASONING]), "".join(parts[CONTENT]))
