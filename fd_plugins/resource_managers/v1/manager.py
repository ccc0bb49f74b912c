"""The ``v1`` KV resource manager: a per-step token budget over a prefix-cached block pool.

Mental model (after vLLM v1 and FastDeploy's ResourceManagerV1): there are no prefill or decode
phases. Each request has ``num_tokens`` known tokens, of which ``num_computed_tokens`` have K/V
in the cache; every step hands out at most ``max_num_batched_tokens`` tokens so that computed
counts catch up. One prompt may take several steps (chunked prefill); a decode row is simply a
request one token behind, or one token plus its proposed tokens (``Request.spec_token_ids``,
speculative decoding), which count against the budget like any other.

``schedule`` in order:

1. Full blocks computed in earlier steps are registered in the prefix cache.
2. RUNNING requests, in admission order, while budget is left: ``n = min(behind, budget)``,
   chunked (``fd_prefill_chunk_size`` hook, else ``long_prefill_token_threshold``); blocks are
   taken for ``computed + n`` tokens. When the pool runs dry a victim is preempted
   (``fd_select_preemption_victim``, default: the last admitted of the call running the most
   requests, see ``Request.call_id``) by recompute: it loses its blocks and its row if it had
   one this step (the budget is refunded), gets ``num_computed_tokens = 0`` and goes back to
   the *front* of ``waiting``. A request that preempts itself is not scheduled this step.
3. WAITING requests, only if nothing was preempted this step and while fewer than
   ``max_num_seqs`` run, calls taking turns: next is the first waiting request of the calls
   running the fewest requests (FIFO when every request is a call of its own), so that the
   preempted choices of a large-``n`` call do not stay ahead of another call's request (issue 41
   item 20). Prefix-cache hits first (none for a request that needs prompt logprobs: it computes
   every prompt position), then the rest is chunked as above. With
   chunked prefill off, a prompt that does not fit the budget left waits (and, FCFS, so does
   everyone behind it) — unless it is longer than the whole budget, in which case it is chunked
   anyway since it could never run otherwise. The first request whose blocks do not fit stops
   admission (strict FCFS in that order), except for a request whose call runs none: for it,
   victims are preempted as above (hook, else the default) while the victim's call runs two or
   more requests, until its blocks fit, so that one call's choices cannot hold the whole pool
   while another call waits.

Liveness: the engine admits only requests whose ``prompt + max_tokens`` fits the pool, and the
default victim is never the oldest running request while another runs (it would be the latest
admitted of its call, so its call would run one request, so would every call, and the victim is
then the last admitted), so the oldest running request can always take the whole pool and finish.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import StepPlan
from fd_core.plugin_guard import GuardedHooks
from fd_core.request import FinishReason, RequestStatus
from fd_plugins.resource_managers._common import BlockTable, QueuedBlockManager, cdiv
from fd_plugins.resource_managers.block_pool import BlockPool
from fd_plugins.resource_managers.v1.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from fd_core.contracts.resource_manager import KVLimits, KVStats
    from fd_core.outputs import ScheduledRequest
    from fd_core.request import Request
    from fd_plugins.resource_managers.block_pool import KVBlock


class V1Settings(BaseModel):
    """``[resource_manager.options]`` of ``v1``."""

    model_config = ConfigDict(extra="forbid")

    long_prefill_token_threshold: int | None = Field(
        None, gt=0, description="Most prompt tokens one request computes per step when chunked "
                                "prefill is on (the fd_prefill_chunk_size hook overrides it); "
                                "None: only the step budget limits it.")


class V1ResourceManager(QueuedBlockManager):
    """Token-budget scheduler with chunked prefill, recompute preemption and prefix caching."""

    name: ClassVar[str] = "v1"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    supports_prefix_caching: ClassVar[bool] = True
    settings_model: ClassVar[type[BaseModel]] = V1Settings

    def __init__(self, settings: V1Settings | None, *, limits: KVLimits, hooks: Any) -> None:
        settings = settings or V1Settings()
        self.prefix_cache = PrefixCache(limits.block_size) if limits.enable_prefix_caching else None
        pool = BlockPool(limits.num_blocks,
                         on_evict=self.prefix_cache.forget if self.prefix_cache is not None else None)
        super().__init__(settings, limits=limits, hooks=hooks, pool=pool)
        self._decisions = GuardedHooks(hooks)
        self._long_prefill_threshold = settings.long_prefill_token_threshold
        self._hashes: dict[str, list[bytes]] = {}   # request id -> its chain of full-block hashes
        self._cache_queries = 0                     # tokens looked up in the prefix cache
        self._cache_hits = 0                        # tokens found there

    # --- the contract ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step as the module docstring describes: running first, then waiting."""
        now = time.time()
        budget = self.limits.max_num_batched_tokens
        rows: dict[str, ScheduledRequest] = {}     # this step's rows, in planning order
        preempted: list[str] = []
        if self.prefix_cache is not None:
            for request in self.running:
                self._cache_full_blocks(request)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            behind = request.num_tokens_with_spec - request.num_computed_tokens   # proposals count too
            if behind == 0:
                i += 1
                continue
            n = self._chunk(request, behind, budget)
            missing = self._blocks_missing(request, request.num_computed_tokens + n)
            while missing > self.pool.num_free:
                victim = self._select_victim(request)
                if self.running.index(victim) < i:
                    i -= 1
                budget += self._preempt(victim, rows)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                continue   # it preempted itself; ``i`` already points at the next one
            if missing:
                self._grow(request, missing)
            rows[request.request_id] = self._row(request, n, now)
            budget -= n
            i += 1

        if not preempted:
            budget = self._admit_waiting(rows, preempted, budget, now)
        return StepPlan(list(rows.values()), preempted, self.limits.max_num_batched_tokens - budget)

    def finish_requests(self, requests: list[Request], reason: FinishReason) -> None:
        # After a stop or length finish the last step ran, so its full blocks hold valid K/V;
        # after an error they may not, and must not be offered to other requests.
        if self.prefix_cache is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            for request in requests:
                if request.request_id in self.tables:
                    self._cache_full_blocks(request)
        super().finish_requests(requests, reason)

    def stats(self) -> KVStats:
        stats = super().stats()
        stats.prefix_cache_queries = self._cache_queries
        stats.prefix_cache_hits = self._cache_hits
        return stats

    # --- steps of schedule -------------------------------------------------------------------

    def _admit_waiting(self, rows: dict[str, ScheduledRequest], preempted: list[str], budget: int,
                       now: float) -> int:
        """Admit waiting requests, calls taking turns, into the budget left; return what is left then."""
        bs = self.limits.block_size
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self._next_waiting()
            hits = self._cache_hits_for(request)
            num_cached = len(hits) * bs
            behind = request.num_tokens - num_cached
            if not self.limits.enable_chunked_prefill and budget < behind <= self.limits.max_num_batched_tokens:
                break
            n = self._chunk(request, behind, budget)
            new_blocks = cdiv(num_cached + n, bs) - len(hits)
            revived = sum(1 for b in hits if b.ref_cnt == 0)   # hits that leave the free queue
            if new_blocks + revived > self.pool.num_free:
                refund = self._preempt_for_newcomer(request, rows, preempted)
                if refund is None:
                    break
                budget += refund
                continue   # the victim's blocks are free (some may be hits): look at the request again
            if self._looks_up(request):
                self._cache_queries += request.num_tokens
                self._cache_hits += num_cached
            self.pool.touch(hits)
            self._start_running(request, BlockTable(hits, [b.block_id for b in hits], len(hits)))
            self._grow(request, new_blocks)
            request.num_computed_tokens = num_cached
            if request.scheduled_time is None:
                request.num_cached_tokens = num_cached
            rows[request.request_id] = self._row(request, n, now)
            budget -= n
        return budget

    def _chunk(self, request: Request, behind: int, budget: int) -> int:
        """Tokens of ``request`` to compute now: all it is behind, within budget and chunk size."""
        n = min(behind, budget)
        if behind == 1 or not self.limits.enable_chunked_prefill:
            return n
        proposal = self._decisions.decide("fd_prefill_chunk_size", _is_token_count,
                                        request=request, remaining_prompt=behind, budget=budget)
        if proposal is not None:
            return max(1, min(int(proposal), n))
        if self._long_prefill_threshold is not None:
            return min(n, self._long_prefill_threshold)
        return n

    def _select_victim(self, needed_by: Request) -> Request:
        running = list(self.running)

        def is_running(victim: Any) -> str | None:
            return None if any(r is victim for r in running) else "is not one of the running requests it was given"

        victim = self._decisions.decide("fd_select_preemption_victim", is_running, running=running,
                                      needed_by=needed_by)
        return self._default_victim() if victim is None else victim

    def _preempt_for_newcomer(self, request: Request, rows: dict[str, ScheduledRequest],
                              preempted: list[str]) -> int | None:
        """Preempt one request so that ``request``, whose call runs none, gets blocks: the victim
        (``fd_select_preemption_victim``, else the default) must belong to a call running two or
        more. Returns the budget its row gave back, or None when there is no such victim."""
        running = Counter(r.call_id for r in self.running)
        if running[request.call_id]:
            return None
        victim = self._select_victim(request)
        if running[victim.call_id] < 2:
            return None
        preempted.append(victim.request_id)
        return self._preempt(victim, rows)

    def _default_victim(self) -> Request:
        """The last admitted request of the call running the most (the last admitted when each
        request is a call of its own)."""
        running = Counter(r.call_id for r in self.running)
        most = max(running.values())
        return next(r for r in reversed(self.running) if running[r.call_id] == most)

    def _next_waiting(self) -> Request:
        """The first waiting request of the calls running the fewest requests."""
        running = Counter(r.call_id for r in self.running)
        return min(self.waiting, key=lambda r: running[r.call_id])

    def _preempt(self, victim: Request, rows: dict[str, ScheduledRequest]) -> int:
        """Recompute-preempt ``victim``; return the budget its row of this step gave back."""
        row = rows.pop(victim.request_id, None)
        self._release(victim)
        self.running.remove(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(victim)
        return row.num_new_tokens if row is not None else 0

    # --- prefix caching ----------------------------------------------------------------------

    def _looks_up(self, request: Request) -> bool:
        """Whether ``request`` may start from prefix-cache hits. One that needs prompt logprobs
        computes every prompt position (its full blocks are still cached for others)."""
        return self.prefix_cache is not None and not request.needs_prompt_logprobs

    def _cache_hits_for(self, request: Request) -> list[KVBlock]:
        if not self._looks_up(request):
            return []
        assert self.prefix_cache is not None
        return self.prefix_cache.match(request, self._hashes.setdefault(request.request_id, []))

    def _cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V are computed (earlier steps)."""
        assert self.prefix_cache is not None
        table = self.tables[request.request_id]
        full = request.num_computed_tokens // self.limits.block_size
        if full <= table.num_cached_blocks:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        self.prefix_cache.extend_hashes(request, hashes, full)
        for i in range(table.num_cached_blocks, full):
            self.prefix_cache.insert(table.blocks[i], hashes[i])
        table.num_cached_blocks = full

    def _retire(self, request: Request) -> None:
        super()._retire(request)
        self._hashes.pop(request.request_id, None)


def _is_token_count(answer: Any) -> str | None:
    """Check of an ``fd_prefill_chunk_size`` answer (the manager clamps it into range)."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        return None
    return "is not an int"
