"""The engine's side of guided decoding: compile on admission, one matcher per sequence, masks per step.

:class:`Constraints` sits between the engine and the selected
:class:`~fd_core.contracts.guided_decoding.GuidedDecodingBackend`. :meth:`Constraints.check`
compiles a request's constraint when it enters (the backend caches), so one that does not
compile refuses the request. :meth:`Constraints.mask` runs in the sampler, on the rows that have a
constraint: it brings each row's matcher up to the request's ``output_token_ids`` (a matcher is
made the first time a request is sampled, so a continuation, a preempted request or a prefill
instance's first token all replay what was already generated), fills the rows of one bitmask and
sets every forbidden logit to ``-inf`` (one vectorised pass per row, in place). Rows without a constraint are not
touched.

A constraint with reasoning tags (``GuidedDecoding.reasoning_end``) applies to the answer after the
reply's reasoning: a :class:`~fd_core.runner.answer_start.ReplyScan` reads the output until the
answer starts, and the matcher takes the tokens from there. While the reply reasons its row is not
masked (but for the few tokens that would end the tag in their middle); while it may still open
its reasoning, the row allows the constraint's tokens and the start tag's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fd_core.contracts.guided_decoding import ConstraintError, mask_words
from fd_core.errors import RequestError
from fd_core.runner.answer_start import ANSWER, OPENING, REASONING, ReasoningTags, ReplyScan

if TYPE_CHECKING:
    from fd_core.contracts.guided_decoding import ConstraintMatcher, GuidedDecodingBackend
    from fd_core.request import GuidedDecoding, Request

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    compiled: Any                       # the backend's compiled constraint (a fresh matcher starts the answer)
    matcher: ConstraintMatcher | None   # None while the reply reasons
    reply: ReplyScan | None             # where the answer starts (a constraint with reasoning tags), else None
    read: int = 0                       # how many of the request's output tokens were taken
    fits: bool = True                   # every token fed to the matcher was accepted (opening: it may not be)


class _Unservable(Exception):
    """Why a row cannot go on (its request ends with this message)."""


class Constraints:
    """Guided-decoding state of one engine: the backend (or why there is none) and the live matchers.

    ``backend`` is None when the selected backend cannot run here; ``unavailable`` then says why,
    and every constrained request is refused with it. ``token_bytes[i]`` is token ``i``'s bytes in
    decoded text (``Tokenizer.token_bytes``): reasoning tags are looked for in them.
    """

    def __init__(self, backend: GuidedDecodingBackend | None, *, vocab_size: int, unavailable: str = "",
                 token_bytes: Sequence[bytes] = ()) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.unavailable = unavailable
        self.token_bytes = token_bytes
        self._sequences: dict[str, _Sequence] = {}
        self._tags: dict[tuple[str | None, str], ReasoningTags] = {}

    def check(self, request: Request) -> Any:
        """Compile the request's constraint (cached); RequestError naming ``guided`` when it cannot be
        served. Requests without one pass. Any thread."""
        params = request.sampling_params
        if params.guided is None:
            return None
        if self.backend is None:
            raise RequestError("guided", f"guided: this server cannot apply constraints: {self.unavailable}")
        if params.ignore_eos:
            raise RequestError("ignore_eos", "ignore_eos: cannot be combined with a constraint, which ends the "
                               "output once it is complete")
        try:
            compiled = self.backend.compile(params.guided)
        except ConstraintError as exc:
            raise RequestError("guided", f"guided: the {params.guided.kind} constraint does not compile: "
                               f"{exc}") from None
        self._reasoning_tags(params.guided)   # built here, off the step loop, once per pair of tags
        return compiled

    def mask(self, logits: np.ndarray, requests: list[Request]) -> dict[int, str]:
        """Set the logits each row's constraint forbids to ``-inf`` (in place, float32 ``[B, V]``);
        returns row -> why it cannot go on, for rows left with no allowed token."""
        rows = [row for row, request in enumerate(requests) if request.sampling_params.guided is not None]
        if not rows:
            return {}
        failed: dict[int, str] = {}
        bitmask = np.zeros((len(rows), mask_words(self.vocab_size)), dtype=np.int32)
        masked: list[tuple[int, int]] = []   # (bitmask slot, logits row) of the rows the bitmask decides
        for slot, row in enumerate(rows):
            try:
                unmasked = self._fill(requests[row], bitmask, slot)
            except _Unservable as exc:
                failed[row] = str(exc)
                continue
            if unmasked is None:
                masked.append((slot, row))
            else:   # the reply reasons: only the tokens that would end the tag in their middle are out
                logits[row, unmasked] = -np.inf
        if not masked:
            return failed
        slots = [slot for slot, _ in masked]
        forbidden = np.unpackbits(bitmask[slots].view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[-1]] == 0
        for index, (_, row) in enumerate(masked):
            np.copyto(logits[row], -np.inf, where=forbidden[index])
            if not np.isfinite(logits[row]).any():
                failed[row] = self._dead_end(requests[row])
        return failed

    def forget(self, request_id: str) -> None:
        """Drop the request's matcher (it finished, or was aborted)."""
        self._sequences.pop(request_id, None)

    def can_verify(self, request: Request) -> bool:
        """Whether proposed tokens of ``request`` can be verified under its constraint (speculative
        decoding): none, or one without reasoning tags whose backend's matchers roll back."""
        guided = request.sampling_params.guided
        return guided is None or (self.backend is not None and self.backend.supports_rollback
                                  and guided.reasoning_end is None)

    def forbidden_in_run(self, request: Request, proposed: Sequence[int]) -> tuple[np.ndarray, str | None]:
        """The tokens ``request``'s constraint forbids at each position of a verified run (bool
        ``[m, V]``): row ``j`` after its outputs and ``proposed[:j]``. ``m - 1`` proposals can be
        verified: ``m`` stops early where the constraint forbids the next proposal or allows no token
        after it. Returns an empty array and why when the first position allows no token. The matcher
        is left where it was (the proposals are rolled back)."""
        try:
            sequence = self._sequence(request)
            self._catch_up(sequence, request)
            matcher = sequence.matcher
            assert sequence.reply is None and matcher is not None, "can_verify() admits no reasoning tags"
            bitmask = np.zeros((1, mask_words(self.vocab_size)), dtype=np.int32)
            rows: list[np.ndarray] = []
            accepted = 0   # proposals the matcher took, to roll back
            try:
                while not matcher.is_terminated():
                    matcher.fill_mask(bitmask, 0)
                    forbidden = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:self.vocab_size] == 0
                    if forbidden.all():
                        break
                    rows.append(forbidden)
                    if accepted == len(proposed) or not matcher.accept(proposed[accepted]):
                        break
                    accepted += 1
            finally:
                if accepted:
                    matcher.rollback(accepted)
        except (_Unservable, RequestError) as exc:
            return np.zeros((0, self.vocab_size), bool), str(exc)
        except Exception as exc:   # the backend failed on this sequence: it alone ends
            log.exception("guided decoding failed on request %s", request.request_id)
            return np.zeros((0, self.vocab_size), bool), (f"guided: the guided-decoding backend failed: "
                                                          f"{type(exc).__name__}: {exc}")
        if not rows:
            return np.zeros((0, self.vocab_size), bool), self._dead_end(request)
        return np.stack(rows), None

    def _fill(self, request: Request, bitmask: np.ndarray, slot: int) -> np.ndarray | None:
        """Fill the request's row of ``bitmask``, or (while its reply reasons) return the token ids to
        mask instead; _Unservable when it cannot go on. A backend that raises fails this row only."""
        try:
            sequence = self._sequence(request)
            self._catch_up(sequence, request)
            phase = ANSWER if sequence.reply is None else sequence.reply.phase
            if phase == REASONING:
                assert sequence.reply is not None
                return sequence.reply.overshooting()
            assert sequence.matcher is not None
            if sequence.fits:
                if sequence.matcher.is_terminated():
                    raise _Unservable("guided: the constraint is complete and a stop token was generated")
                sequence.matcher.fill_mask(bitmask, slot)
            if phase == OPENING:   # the start tag's next tokens are allowed beside the constraint's
                assert sequence.reply is not None
                _allow(bitmask[slot], sequence.reply.tag_tokens())
        except _Unservable:
            raise
        except RequestError as exc:
            raise _Unservable(str(exc)) from None
        except Exception as exc:   # the backend failed on this sequence: it alone ends
            log.exception("guided decoding failed on request %s", request.request_id)
            raise _Unservable(f"guided: the guided-decoding backend failed: {type(exc).__name__}: {exc}") from None
        return None

    def _sequence(self, request: Request) -> _Sequence:
        """The request's sequence state, made at the start of its reply the first time it is sampled."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            compiled = self.check(request)
            guided = request.sampling_params.guided
            assert guided is not None and self.backend is not None
            tags = self._reasoning_tags(guided)
            reply = None if tags is None else ReplyScan.begin(tags)
            reasons = reply is not None and reply.phase == REASONING
            matcher = None if reasons else self.backend.matcher(compiled, _stop_ids(request))
            sequence = self._sequences[request.request_id] = _Sequence(compiled, matcher, reply)
        return sequence

    def _catch_up(self, sequence: _Sequence, request: Request) -> None:
        """Take the output tokens not taken yet: the reply scan's until the answer starts, the matcher's
        from there (while the reply may still open its reasoning, both)."""
        outputs = request.output_token_ids
        reply = sequence.reply
        while sequence.read < len(outputs):
            token = outputs[sequence.read]
            before = ANSWER if reply is None else reply.phase
            if before != REASONING:
                assert sequence.matcher is not None
                sequence.fits = sequence.fits and sequence.matcher.accept(token)
            if reply is not None and before != ANSWER:
                reply.read(token)
                if reply.phase == REASONING:   # the start tag is complete: no constraint until the end tag
                    sequence.matcher, sequence.fits = None, True
                elif reply.phase == ANSWER and before == REASONING:   # the answer starts with the next token
                    assert self.backend is not None
                    sequence.matcher = self.backend.matcher(sequence.compiled, _stop_ids(request))
            if not sequence.fits and (reply is None or reply.phase == ANSWER):
                raise _Unservable(f"guided: the output's token {token} (at {sequence.read}) breaks the constraint")
            sequence.read += 1

    def _reasoning_tags(self, guided: GuidedDecoding) -> ReasoningTags | None:
        """The tables of the constraint's reasoning tags (None: it applies from the first token).
        Two threads may build the same tables at once; either copy serves."""
        if guided.reasoning_end is None:
            return None
        key = (guided.reasoning_start, guided.reasoning_end)
        tags = self._tags.get(key)
        if tags is None:
            assert self.token_bytes, "an engine with a guided-decoding backend is given the tokens' bytes"
            tags = self._tags[key] = ReasoningTags(guided.reasoning_start, guided.reasoning_end, self.token_bytes)
        return tags

    @staticmethod
    def _dead_end(request: Request) -> str:
        params = request.sampling_params
        if len(request.output_token_ids) < params.min_tokens:
            return (f"guided: the constraint was complete after {len(request.output_token_ids)} tokens, before "
                    f"min_tokens ({params.min_tokens}); no token can follow")
        if not _stop_ids(request):
            return "guided: the constraint is complete, and the request has no stop token id to end with"
        return "guided: no token of the vocabulary can continue the constraint"


def _stop_ids(request: Request) -> tuple[int, ...]:
    """The ids that end ``request`` (ignore_eos is refused with a constraint)."""
    return tuple(dict.fromkeys((*request.eos_token_ids, *request.sampling_params.stop_token_ids)))


def _allow(row: np.ndarray, token_ids: np.ndarray) -> None:
    """Set the bits of ``token_ids`` in one bitmask row (int32 words, see the contract)."""
    words = row.view(np.uint32)
    np.bitwise_or.at(words, token_ids >> 5, np.left_shift(np.uint32(1), (token_ids & 31).astype(np.uint32)))
