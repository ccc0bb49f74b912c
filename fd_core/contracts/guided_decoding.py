"""Contract of the guided-decoding seam: constraints compiled once, a matcher per sequence, a mask per step.

A request may carry a :class:`~fd_core.request.GuidedDecoding` constraint (a JSON schema, any JSON
object, a regex, a list of choices, a grammar, a structural tag). The engine asks the backend to
:meth:`~GuidedDecodingBackend.compile` it when the request comes in (a constraint that does not
compile refuses the request, naming the field), then keeps one :class:`ConstraintMatcher` per
sequence. Before each token is sampled the matcher fills that row of a token bitmask; the sampler
sets every token whose bit is clear to ``-inf``; the sampled token is then fed back with
:meth:`ConstraintMatcher.accept`.

The engine builds a matcher lazily, the first time a request is sampled, and first feeds it the
request's ``output_token_ids``: a continuation re-served by the pool or a data-parallel rank, a
preempted request and a prefill instance's first token all follow the same constraint without
state travelling with the request. A constraint on the answer of a reasoning reply
(``GuidedDecoding.reasoning_end``) is the engine's business, not the backend's: it feeds the matcher
only the answer's tokens and leaves the reasoning's rows unmasked (``fd_core.runner.answer_start``);
a backend compiles ``kind`` and ``spec`` and ignores the tags.

Invariants the engine relies on (``fd_core.testing.conformance.check_guided_decoding`` checks them):
- Every kind in :attr:`~GuidedDecodingBackend.supported_kinds` compiles; :meth:`~GuidedDecodingBackend.compile`
  of another kind, or of a constraint that does not compile, raises :class:`ConstraintError` with a
  one-line message for the client (the kind, or what is wrong with the spec).
- :meth:`~GuidedDecodingBackend.compile` is deterministic and cheap to call again with an equal
  constraint (the backend caches): an equal constraint's matchers behave the same.
- Every token a filled mask allows is accepted by :meth:`~ConstraintMatcher.accept`; a token it
  refuses changes nothing. The mask allows the tokens that keep the output the beginning of one
  that satisfies the constraint (all of them, but that a backend may fix where JSON puts whitespace),
  and the matcher's stop token ids exactly where the output so far satisfies it (tokens that extend
  it may be allowed beside them); never an id that is not text (padding, special tokens other than
  the stop ids). An output that follows the mask to a stop id therefore satisfies the constraint.
- Matchers share no state: a matcher is used by one thread at a time; different matchers (of one
  compiled constraint too) may be used from different threads.

Bitmask layout (xgrammar's, shared by the peers): ``int32 [rows, ceil(vocab_size / 32)]``; token
``t`` is allowed in a row when bit ``t % 32`` of word ``t // 32`` is set; the bits past
``vocab_size`` (``Vocabulary.size``) in a row's last word mean nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fd_core.contracts._base import SeamPlugin
from fd_core.request import GUIDED_KINDS

if TYPE_CHECKING:
    import numpy as np
    from pydantic import BaseModel

    from fd_core.request import GuidedDecoding


class ConstraintError(ValueError):
    """A constraint the backend cannot compile (or of a kind it does not support); the message says
    why, on one line, for the client."""


class GuidedDecodingUnavailable(RuntimeError):
    """The backend cannot run here (its library is not installed); the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What a backend needs to know about the model's tokens.

    ``tokens[i]`` is token ``i`` as the tokenizer spells it in its vocabulary (byte-level BPE
    spellings such as ``"Ġthe"``, SentencePiece's ``"▁the"`` and ``"<0x0A>"``); ``size`` is the
    width of the model's logits (it may exceed ``len(tokens)``: the padding ids are never allowed);
    ``tokenizer_json`` is the Hugging Face ``tokenizers`` serialisation, from which a backend may
    read how tokens decode to bytes.
    """

    tokens: tuple[str, ...]
    size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_json: str


def mask_words(vocab_size: int) -> int:
    """Width of one bitmask row: 32 tokens per int32 word."""
    return -(-vocab_size // 32)


class ConstraintMatcher(ABC):
    """Where one sequence stands in its constraint."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) when the constraint forbids it."""

    @abstractmethod
    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, see the module docstring), every
        bit of the row (a forbidden token's is cleared, whatever the row held); no other row changes.
        Not called once the matcher is terminated."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether one of the matcher's stop token ids was accepted (the constraint was complete)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most 16 at a time), back to the state before
        them. Optional (hookspec version 5): speculative decoding masks each proposed position with the
        state after the proposals before it, then rolls them back; a backend whose matchers implement it
        sets ``GuidedDecodingBackend.supports_rollback``."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")


class GuidedDecodingBackend(SeamPlugin, ABC):
    """Compiles constraints for one vocabulary and makes matchers of them.

    Built once per engine, after the model's tokenizer is known. ``settings`` is the validated
    ``[guided_decoding.options]``. A backend whose library is missing raises
    :class:`GuidedDecodingUnavailable` from its constructor: the engine serves on and refuses
    constrained requests with that message.
    """

    #: The :data:`~fd_core.request.GUIDED_KINDS` it compiles; a constraint of another kind raises
    #: :class:`ConstraintError` naming the kind (the client gets a 400).
    supported_kinds: ClassVar[frozenset[str]] = frozenset(GUIDED_KINDS)
    #: Whether its matchers implement :meth:`ConstraintMatcher.rollback`; without it, requests with a
    #: constraint are never speculated (speculative decoding needs to try proposals and undo them).
    supports_rollback: ClassVar[bool] = False

    def __init__(self, settings: BaseModel | None, *, vocabulary: Vocabulary) -> None:
        self.settings = settings
        self.vocabulary = vocabulary

    @abstractmethod
    def compile(self, constraint: GuidedDecoding) -> Any:
        """The compiled form of ``constraint`` (opaque to the engine; cached by the backend).

        Raises :class:`ConstraintError` when it does not compile. Called from any thread.
        """

    @abstractmethod
    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> ConstraintMatcher:
        """A fresh matcher at the start of the constraint ``compiled`` (from :meth:`compile`).

        ``stop_token_ids`` end this request (its end-of-sequence ids and its ``stop_token_ids``; they
        may differ from the vocabulary's ``eos_token_ids``): the mask allows all of them, and no other
        end-of-sequence id, exactly where the output so far completes the constraint.
        """

    def stats(self) -> dict[str, float]:
        """Figures for ``/metrics`` (compile cache hits, compile seconds...); the default has none."""
        return {}
