"""The ``v0`` KV resource manager: slot-based admission of whole prompts, no preemption.

Model (after FastDeploy's first resource manager): a request takes one of ``max_num_seqs``
slots and the blocks of its whole prompt when admitted, computes the prompt in one step (no
chunked prefill, whatever ``enable_chunked_prefill`` says), then decodes one token per step,
taking one more block whenever its next token crosses a block boundary (with speculative
decoding, its proposed tokens run with its last one, as far as the step's budget allows). Nothing
is ever preempted and there is no prefix caching.

Admission rule, and why it cannot deadlock: the head of ``waiting`` (FIFO) is admitted only if
the free blocks, minus the blocks already promised to running requests, cover its whole life:
``ceil(min(prompt + max_tokens, max_model_len) / block_size)`` blocks. Of those, the prompt's
blocks plus ``reserved_decode_blocks`` are taken at once and the rest stay *promised*. Decode
growth draws on the request's own promise, so it never finds the pool empty while a request is
within its declared length, and every running request can always run to completion. A request
that outgrows its promise (an engine that ignores ``max_tokens``) may still take unpromised free
blocks; when none are left it waits that step instead of being preempted.

Prompts longer than ``max_num_batched_tokens``: v0 cannot chunk, so such a prompt is admitted
(when it reaches the head of ``waiting`` and its blocks fit) in a step of its own, in which the
running requests pause. That one step exceeds the token budget; it is the only exception to the
budget invariant, and cannot happen when ``max_num_batched_tokens >= max_model_len``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import StepPlan
from fd_plugins.resource_managers._common import BlockTable, QueuedBlockManager, cdiv
from fd_plugins.resource_managers.block_pool import BlockPool

if TYPE_CHECKING:
    from fd_core.contracts.resource_manager import KVLimits
    from fd_core.request import Request


class V0Settings(BaseModel):
    """``[resource_manager.options]`` of ``v0``."""

    model_config = ConfigDict(extra="forbid")

    reserved_decode_blocks: int = Field(
        1, ge=0, description="Blocks taken at admission beyond the prompt's, so that the first "
                             "decode steps need no allocation (capped by the request's length).")


class V0ResourceManager(QueuedBlockManager):
    """Whole-prompt admission with blocks promised for each request's full length."""

    name: ClassVar[str] = "v0"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = V0Settings

    def __init__(self, settings: V0Settings | None, *, limits: KVLimits, hooks: Any) -> None:
        settings = settings or V0Settings()
        super().__init__(settings, limits=limits, hooks=hooks, pool=BlockPool(limits.num_blocks))
        self._reserved_decode_blocks = settings.reserved_decode_blocks
        self._promised: dict[str, int] = {}   # running request id -> blocks still promised to it
        self._num_promised = 0                # == sum(self._promised.values())

    def schedule(self) -> StepPlan:
        """Running requests decode first (one token each), then waiting ones are admitted FIFO."""
        now = time.time()
        plan = StepPlan()
        budget = self.limits.max_num_batched_tokens
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.num_tokens > budget:
            if self._can_admit(head):   # an oversized prompt gets a step of its own
                self._admit(head, plan, now)
            else:
                self._schedule_running(plan, budget, now)
            return plan
        budget = self._schedule_running(plan, budget, now)
        while self.waiting and self.waiting[0].num_tokens <= budget and self._can_admit(self.waiting[0]):
            budget -= self._admit(self.waiting[0], plan, now)
        return plan

    def reserve(self, request: Request) -> list[int] | None:
        """Like admission: only when the request's whole lifetime fits what is not promised."""
        if not self._can_admit(request):
            return None
        ids = super().reserve(request)
        assert ids is not None, "_can_admit checked the room"
        promised = self._lifetime_blocks(request) - len(ids)
        self._promised[request.request_id] = promised
        self._num_promised += promised
        return ids

    def _schedule_running(self, plan: StepPlan, budget: int, now: float) -> int:
        """Add a row for each running request that has room; return the budget left."""
        for request in self.running:
            known = request.num_tokens - request.num_computed_tokens
            if known == 0 or known > budget:
                continue
            n = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)   # with its proposals
            missing = self._blocks_missing(request, request.num_computed_tokens + n)
            if missing:
                own = min(missing, self._promised[request.request_id])
                if missing - own > self.pool.num_free - self._num_promised:
                    continue   # beyond its declared length and the pool is spoken for: wait
                self._promised[request.request_id] -= own
                self._num_promised -= own
                self._grow(request, missing)
            self._add(plan, request, n, now)
            budget -= n
        return budget

    def _lifetime_blocks(self, request: Request) -> int:
        tokens = min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.limits.max_model_len)
        return cdiv(max(tokens, request.num_tokens), self.limits.block_size)

    def _can_admit(self, request: Request) -> bool:
        return (len(self.running) < self.limits.max_num_seqs
                and self._lifetime_blocks(request) <= self.pool.num_free - self._num_promised)

    def _admit(self, request: Request, plan: StepPlan, now: float) -> int:
        """Start ``request`` with its prompt (+ reserved) blocks; return the tokens planned."""
        lifetime = self._lifetime_blocks(request)
        first = min(lifetime, cdiv(request.num_tokens, self.limits.block_size)
                    + self._reserved_decode_blocks)
        self._start_running(request, BlockTable())
        self._grow(request, first)
        self._promised[request.request_id] = lifetime - first
        self._num_promised += lifetime - first
        n = request.num_tokens
        self._add(plan, request, n, now)
        return n

    def _add(self, plan: StepPlan, request: Request, n: int, now: float) -> None:
        plan.scheduled.append(self._row(request, n, now))
        plan.total_num_tokens += n

    def _release(self, request: Request) -> None:
        super()._release(request)
        self._num_promised -= self._promised.pop(request.request_id, 0)
