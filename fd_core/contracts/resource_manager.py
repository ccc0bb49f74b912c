"""Contract of the ResourceManager seam: owns the KV blocks and plans each step's batch.

Call order per step: the engine hands new requests to :meth:`ResourceManager.add_request`,
calls :meth:`schedule` once, runs the plan, and then ends the requests that finished through
:meth:`finish_requests` (once per finish reason). Aborts and errors end requests the same way,
between steps. The engine core alone ends requests: a manager never sets ``FINISHED`` itself
(until hookspec version 1 it did, and had an ``abort`` method; ``finish_requests`` with
``FinishReason.ABORT`` replaces it).

Invariants every implementation keeps (checked by ``fd_core.testing.conformance``):
- ``plan.total_num_tokens <= max_num_batched_tokens`` and ``len(plan.scheduled) <= max_num_seqs``;
  the one exception: a manager without chunked prefill (v0) may plan a whole prompt longer
  than the budget as the only row of a step, since it could never run otherwise.
- ``schedule`` advances ``request.num_computed_tokens`` by the planned tokens at once, so
  the next step's plan continues where this one ends.
- A block is owned by its requests (reference counted when shared through prefix caching);
  it is never freed twice, counts never go negative, and once every request has finished or
  been aborted, :meth:`num_free_blocks` equals :attr:`num_blocks`.
- A preempted request loses all its blocks, gets ``num_computed_tokens = 0`` and is
  scheduled again later (recompute); its id appears in ``plan.preempted_ids``.
- A request whose ``needs_prompt_logprobs`` is true is planned from position 0: no prefix-cache
  hits (it computes every prompt position). The core ends one that skipped positions with an error.
- Speculative decoding (hookspec version 5): a running request may carry proposed tokens
  (``request.spec_token_ids``) after its known ones. A manager may plan them in the request's row,
  up to ``request.num_tokens_with_spec`` (they count against the token budget and need blocks like
  known tokens); ``sample`` is set when the row reaches ``request.num_tokens``. After the step the core
  lowers ``num_computed_tokens`` to the accepted positions (a rejected position's K/V is
  overwritten later in the blocks the request keeps). A manager that plans only known tokens
  (``request.num_tokens``) stays correct: its requests just decode one token per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fd_core.outputs import StepPlan
    from fd_core.request import FinishReason, Request


@dataclass(frozen=True, slots=True)
class KVLimits:
    """The numbers a resource manager plans within."""

    num_blocks: int               # KV blocks in the pool
    block_size: int               # tokens per block
    max_num_seqs: int             # most rows in a step
    max_num_batched_tokens: int   # most tokens in a step
    max_model_len: int            # most tokens (prompt + output) of one request
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False


@dataclass(slots=True)
class KVStats:
    """Counters for /metrics and tests; all are totals since start unless noted."""

    num_blocks: int
    num_free_blocks: int          # now
    num_running: int              # now
    num_waiting: int              # now
    num_preemptions: int = 0
    prefix_cache_queries: int = 0     # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0        # prompt tokens found there


class ResourceManager(SeamPlugin, ABC):
    """Admits requests, allocates KV blocks and builds each step's plan."""

    #: Whether it reuses blocks of shared prompt prefixes; ``cache.enable_prefix_caching = true``
    #: with a manager that does not is a config error, and unset means this value.
    supports_prefix_caching: ClassVar[bool] = False
    #: Whether it implements :meth:`reserve`, which a decode instance (``splitwise.role =
    #: "decode"``) needs; selecting one that does not for that role is a config error.
    supports_reserve: ClassVar[bool] = False

    def __init__(self, settings: BaseModel | None, *, limits: KVLimits, hooks: Any) -> None:
        """``hooks`` is the pluggy relay (``fd_select_preemption_victim``, ``fd_prefill_chunk_size``)."""
        self.settings = settings
        self.limits = limits
        self.hooks = hooks

    @property
    def num_blocks(self) -> int:
        return self.limits.num_blocks

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Accept a validated request into the waiting queue. It may already have output tokens
        and ``num_computed_tokens == 0`` (a continuation re-served by the pool or a dp rank, or a
        request the engine parked to share its slots and gives back; it was ended here with
        ``finish_requests(..., ABORT)`` before): its prompt and those tokens are recomputed, as after
        a preemption."""

    def reserve(self, request: Request) -> list[int] | None:
        """Take blocks for the whole prompt of a validated ``request`` whose prompt KV will be
        written into them by another instance (decode role; added in hookspec version 3).

        Returns the block ids in position order, or None when there is no room now (free blocks
        or ``max_num_seqs``), taking nothing. A reserved request counts as running with its prompt
        computed (``num_computed_tokens = num_prompt_tokens``) and is never planned until it has
        an output token (the first token, from the prefill side); from then on it decodes like any
        other. ``finish_requests`` frees it like any other; it may be preempted, and then
        recomputes its prompt here.
        """
        raise NotImplementedError(f"resource manager {self.name!r} cannot reserve blocks for a decode instance")

    @abstractmethod
    def schedule(self) -> StepPlan:
        """Plan the next step: which requests compute which tokens with which blocks."""

    @abstractmethod
    def finish_requests(self, requests: list[Request], reason: FinishReason) -> None:
        """Forget requests that ended and free their blocks at once, wherever they are (running,
        waiting or preempted); requests it does not hold are ignored. ``reason`` tells whether
        their K/V is complete (``stop``/``length``: it may be kept for prefix caching) or not
        (``abort``/``error``). The core sets their status afterwards."""

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that a new allocation could take now (free or evictable cached blocks)."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    @abstractmethod
    def stats(self) -> KVStats:
        """Current counters."""
