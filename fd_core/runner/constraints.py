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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fd_core.contracts.guided_decoding import ConstraintError, mask_words
from fd_core.errors import RequestError

if TYPE_CHECKING:
    from fd_core.contracts.guided_decoding import ConstraintMatcher, GuidedDecodingBackend
    from fd_core.request import Request

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    matcher: ConstraintMatcher
    accepted: int = 0   # how many of the request's output tokens the matcher has taken


class Constraints:
    """Guided-decoding state of one engine: the backend (or why there is none) and the live matchers.

    ``backend`` is None when the selected backend cannot run here; ``unavailable`` then says why,
    and every constrained request is refused with it.
    """

    def __init__(self, backend: GuidedDecodingBackend | None, *, vocab_size: int, unavailable: str = "") -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.unavailable = unavailable
        self._sequences: dict[str, _Sequence] = {}

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
            return self.backend.compile(params.guided)
        except ConstraintError as exc:
            raise RequestError("guided", f"guided: the {params.guided.kind} constraint does not compile: "
                               f"{exc}") from None

    def mask(self, logits: np.ndarray, requests: list[Request]) -> dict[int, str]:
        """Set the logits each row's constraint forbids to ``-inf`` (in place, float32 ``[B, V]``);
        returns row -> why it cannot go on, for rows left with no allowed token."""
        rows = [row for row, request in enumerate(requests) if request.sampling_params.guided is not None]
        if not rows:
            return {}
        failed: dict[int, str] = {}
        bitmask = np.zeros((len(rows), mask_words(self.vocab_size)), dtype=np.int32)
        for slot, row in enumerate(rows):
            problem = self._fill(requests[row], bitmask, slot)
            if problem is not None:
                failed[row] = problem
        forbidden = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[-1]] == 0
        for slot, row in enumerate(rows):
            np.copyto(logits[row], -np.inf, where=forbidden[slot])
            if row not in failed and not np.isfinite(logits[row]).any():
                failed[row] = self._dead_end(requests[row])
        return failed

    def forget(self, request_id: str) -> None:
        """Drop the request's matcher (it finished, or was aborted)."""
        self._sequences.pop(request_id, None)

    def _fill(self, request: Request, bitmask: np.ndarray, slot: int) -> str | None:
        """Fill the request's row of ``bitmask``; why it cannot be, or None. A backend that raises fails
        this row only."""
        try:
            sequence = self._sequences.get(request.request_id)
            if sequence is None:
                compiled = self.check(request)
                sequence = self._sequences[request.request_id] = _Sequence(
                    self.backend.matcher(compiled, _stop_ids(request)))
            outputs = request.output_token_ids
            while sequence.accepted < len(outputs):
                token = outputs[sequence.accepted]
                if not sequence.matcher.accept(token):
                    return f"guided: the output's token {token} (at {sequence.accepted}) breaks the constraint"
                sequence.accepted += 1
            if sequence.matcher.is_terminated():
                return "guided: the constraint is complete and a stop token was generated"
            sequence.matcher.fill_mask(bitmask, slot)
        except RequestError as exc:
            return str(exc)
        except Exception as exc:   # the backend failed on this sequence: it alone ends
            log.exception("guided decoding failed on request %s", request.request_id)
            return f"guided: the guided-decoding backend failed: {type(exc).__name__}: {exc}"
        return None

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
