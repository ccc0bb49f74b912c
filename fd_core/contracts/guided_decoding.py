"""Contract of the guided-decoding seam: constraints compiled once, a matcher per sequence, a mask per step.

A request may carry a :class:`~fd_core.request.GuidedDecoding` constraint (a JSON schema, a
regex, a grammar, a list of choices). The engine asks the backend to :meth:`~GuidedDecodingBackend.compile`
it when the request comes in (a constraint that does not compile refuses the request, naming the
field), then keeps one :class:`ConstraintMatcher` per sequence. Before each token is sampled the
matcher fills that row of a token bitmask; the sampler sets every token whose bit is clear to
``-inf``; the sampled token is then fed back with :meth:`ConstraintMatcher.accept`.

The engine builds a matcher lazily, the first time a request is sampled, and first feeds it the
request's ``output_token_ids``: a continuation re-served by the pool or a data-parallel rank, a
preempted request and a prefill instance's first token all follow the same constraint without
state travelling with the request. A constraint on the answer of a reasoning reply
(``GuidedDecoding.reasoning_end``) is the engine's business, not the backend's: it feeds the matcher
only the answer's tokens and leaves the reasoning's rows unmasked (``fd_core.runner.answer_start``);
a backend compiles ``kind`` and ``spec`` and ignores the tags.

Invariants the engine relies on (the conformance kit checks them):
- :meth:`~GuidedDecodingBackend.compile` is deterministic and cheap to call again with an equal
  constraint (the backend caches); it raises :class:`ConstraintError` with a message for the client.
- Every token a filled mask allows is accepted by :meth:`~ConstraintMatcher.accept`, and once the
  constraint is complete the mask allows exactly the request's stop token ids.
- A matcher is used by one thread at a time; different matchers may be used from different threads.

Bitmask layout (xgrammar's, shared by the peers): ``int32 [rows, ceil(vocab_size / 32)]``; token
``t`` is allowed in a row when bit ``t % 32`` of word ``t // 32`` is set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    import numpy as np
    from pydantic import BaseModel

    from fd_core.request import GuidedDecoding


class ConstraintError(ValueError):
    """A constraint the backend cannot compile; the message says why, for the client."""


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
        """Write the tokens allowed next into ``bitmask[row]`` (int32, see the module docstring)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and an end-of-sequence id was accepted."""


class GuidedDecodingBackend(SeamPlugin, ABC):
    """Compiles constraints for one vocabulary and makes matchers of them.

    Built once per engine, after the model's tokenizer is known. ``settings`` is the validated
    ``[guided_decoding.options]``. A backend whose library is missing raises
    :class:`GuidedDecodingUnavailable` from its constructor: the engine serves on and refuses
    constrained requests with that message.
    """

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

        ``stop_token_ids`` end this request (its end-of-sequence ids and its ``stop_token_ids``):
        once the constraint is complete the mask allows exactly them; before, none of them.
        """

    def stats(self) -> dict[str, float]:
        """Figures for ``/metrics`` (compile cache hits, compile seconds...); the default has none."""
        return {}
