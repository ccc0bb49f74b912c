"""Conformance kit for ResourceManager plugins: a seeded simulated engine that checks the contract.

Use it from a plugin's own pytest, no model or device needed::

    from fd_core.registry import Registry
    from fd_core.testing.conformance import check_resource_manager

    def test_my_manager_conforms():
        hooks = Registry.from_plugins({}).hooks
        check_resource_manager(lambda limits: MyManager(None, limits=limits, hooks=hooks), seed=0)

The simulated engine adds seeded random requests over time (prompts often share prefixes, so
prefix caches get hits), calls ``schedule()``, appends a fake sampled token to every row with
``sample=True``, finishes requests at ``max_tokens`` (or, now and then, on a fake stop token)
and aborts a few at random. After every step it checks (see :func:`check_resource_manager`);
the first violation raises :class:`ConformanceError` naming the invariant, the seed and the
step (``resource manager invariant 'no block leaks or double frees' broken: ...``).
:func:`run_resource_manager_checks` runs three such traces (tiny pool, no prefix caching, a
budget no prompt exceeds) as the rows of ``fd-serve plugins check``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fd_core.contracts.resource_manager import KVLimits
from fd_core.request import FinishReason, Request, RequestStatus, SamplingParams
from fd_core.testing.conformance._report import (
    Check,
    ConformanceError,
    SeamReport,
    broken,
    run_checks,
)

if TYPE_CHECKING:
    from collections.abc import Collection

    from fd_core.contracts.resource_manager import ResourceManager
    from fd_core.outputs import StepPlan

__all__ = ["DEFAULT_LIMITS", "ConformanceError", "ConformanceReport", "check_resource_manager",
           "run_resource_manager_checks"]

SEAM = "resource_manager"

# The invariants, as failure messages name them.
FRESH = "a new manager has every block free"
BUDGETS = "steps stay within max_num_seqs and max_num_batched_tokens"
ROWS = "each row is one live RUNNING request computing >= 1 token"
ADVANCES = "schedule advances num_computed_tokens by the planned tokens"
CONTINUES = "rows continue where the request's last row ended"
PROMPT_LOGPROBS = "a request that needs prompt logprobs computes its whole prompt"
TABLES = "block tables are valid and only grow at their end"
SHARING = "blocks are shared only through prefix caching"
NO_LEAKS = "no block leaks or double frees"
PREEMPTION = "a preempted request loses its blocks and starts over"
STATS = "stats and has_unfinished agree with the manager's state"
CORE_FINISHES = "the engine core alone sets FINISHED"
DRAINS = "every trace drains"
DRAINED = "after the drain every request is finished and every block free"
#: What a report row stands for until it fails (then the broken invariant names it).
TRACE = "the contract holds over a seeded trace"

#: A deliberately tiny pool, so that preemption and eviction happen often.
DEFAULT_LIMITS = KVLimits(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                          max_model_len=64, enable_chunked_prefill=True, enable_prefix_caching=True)


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    """What a conformance run saw (totals over the run)."""

    steps: int                 # schedule() calls
    num_requests: int
    num_aborted: int
    num_preemptions: int       # ids reported in plan.preempted_ids
    prefix_cache_queries: int  # tokens, from the manager's stats
    prefix_cache_hits: int     # tokens, from the manager's stats
    max_rows: int              # most rows in one step
    max_step_tokens: int       # most tokens in one step


@dataclass(slots=True)
class _Trace:
    """A request to add at ``arrival_step``."""

    arrival_step: int
    request: Request


def check_resource_manager(
    factory: Callable[[KVLimits], ResourceManager], *, seed: int = 0, num_requests: int = 32,
    limits: KVLimits = DEFAULT_LIMITS, max_prompt_len: int | None = None, max_new_tokens: int = 12,
    arrival_spread: int | None = None, abort_prob: float = 0.03, stop_prob: float = 0.02,
    shared_prefix_prob: float = 0.6, vocab_size: int = 50, max_steps: int | None = None,
    allow_lone_oversized_prompt: bool = False, prompt_logprobs_every: int = 0,
) -> ConformanceReport:
    """Drive ``factory(limits)`` through a seeded trace until it drains; check every step.

    Checked after every step:

    * ``len(plan.scheduled) <= max_num_seqs``; ``plan.total_num_tokens`` is the rows' sum and
      ``<= max_num_batched_tokens`` — except, when ``allow_lone_oversized_prompt``, a step whose
      only row computes a whole prompt longer than the budget (managers without chunked prefill);
    * every row: ``num_new_tokens >= 1``, one row per request, the request is RUNNING, ``start`` is
      where the request's previous row ended (a newly admitted one starts at 0 or, with prefix
      caching, at a block boundary before its last token; a request whose ``needs_prompt_logprobs``
      is true always at 0: every ``prompt_logprobs_every``-th request of the trace asks for prompt
      logprobs, none with 0), ``num_computed_tokens`` was advanced to
      ``start + num_new_tokens``, ``sample`` is set exactly when that reaches ``num_tokens``;
    * block tables: ids are in range and distinct, cover ``start + num_new_tokens`` tokens, and a
      running request's table only grows at its end;
    * no block is held by two requests unless prefix caching is on and it sits at the same
      position of both, whose tokens agree up to the end of that block;
    * ``num_free_blocks()`` equals ``num_blocks`` minus the blocks live requests hold;
    * preempted ids are live requests, now PREEMPTED with no computed tokens and no row;
    * ``stats()`` agrees with the above and its counters never decrease;
    * ``finish_requests`` frees at once and does not set FINISHED (the core does); ending a
      request a second time changes nothing.

    After the drain every request is FINISHED with a reason and every block is free.
    Deterministic for a given ``seed`` and a deterministic manager. Raises ConformanceError.
    """
    rng = random.Random(seed)
    traces = _make_traces(rng, limits, num_requests, max_prompt_len, max_new_tokens,
                          arrival_spread, shared_prefix_prob, vocab_size, prompt_logprobs_every)
    manager = factory(limits)
    if max_steps is None:
        total = sum(t.request.num_prompt_tokens + t.request.sampling_params.max_tokens for t in traces)
        max_steps = 20 * total + traces[-1].arrival_step + 100
    sim = _Simulation(manager, limits, seed, allow_lone_oversized_prompt)
    pending = deque(traces)
    if manager.num_free_blocks() != limits.num_blocks:
        sim.fail(f"a new manager has {manager.num_free_blocks()} free blocks, not {limits.num_blocks}", FRESH)

    while pending or manager.has_unfinished():
        if sim.step >= max_steps:
            sim.fail(f"not drained after {max_steps} steps: deadlock or livelock "
                     f"({len(sim.live)} live requests, stats {manager.stats()!r})", DRAINS)
        while pending and pending[0].arrival_step <= sim.step:
            sim.add(pending.popleft().request)
        if sim.live and rng.random() < abort_prob:
            sim.abort(rng.choice(sorted(sim.live)))
        plan = manager.schedule()
        sim.check_plan(plan)
        finished: dict[FinishReason, list[Request]] = {FinishReason.STOP: [], FinishReason.LENGTH: []}
        for row in plan.scheduled:
            if row.sample:
                request = row.request
                request.output_token_ids.append(rng.randrange(vocab_size))
                if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                    finished[FinishReason.LENGTH].append(request)
                elif rng.random() < stop_prob:
                    finished[FinishReason.STOP].append(request)
        for reason, requests in finished.items():
            if requests:
                sim.finish(requests, reason)
        sim.check_blocks()
        sim.step += 1

    sim.check_drained([t.request for t in traces])
    stats = manager.stats()
    return ConformanceReport(steps=sim.step, num_requests=len(traces), num_aborted=sim.num_aborted,
                             num_preemptions=sim.num_preemptions, prefix_cache_queries=stats.prefix_cache_queries,
                             prefix_cache_hits=stats.prefix_cache_hits, max_rows=sim.max_rows,
                             max_step_tokens=sim.max_step_tokens)


#: The budget of the ``strict_budget`` row: no prompt of its trace can exceed it.
_STRICT_LIMITS = KVLimits(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                          max_model_len=64, enable_chunked_prefill=True, enable_prefix_caching=False)


def run_resource_manager_checks(factory: Callable[[KVLimits], ResourceManager], *,
                                supports_prefix_caching: bool = True, seed: int = 0,
                                skip: Collection[str] = (), plugin: str | None = None) -> SeamReport:
    """:func:`check_resource_manager` on four traces, one report row each, without raising.

    * ``tiny_pool``: :data:`DEFAULT_LIMITS` (prefix caching on when ``supports_prefix_caching``),
      where preemption and eviction happen often; a lone whole prompt over the token budget is
      allowed, as the contract allows it to managers without chunked prefill;
    * ``no_prefix_caching``: the same pool with prefix caching off, so no block may be shared;
    * ``strict_budget``: a budget no prompt exceeds, so every step must stay within it;
    * ``prompt_logprobs``: ``tiny_pool`` where every third request asks for prompt logprobs, so
      it may take no prefix-cache hits.
    """
    tiny = dataclasses.replace(DEFAULT_LIMITS, enable_prefix_caching=supports_prefix_caching)
    runs: dict[str, dict[str, Any]] = {
        "tiny_pool": {"limits": tiny, "allow_lone_oversized_prompt": True},
        "no_prefix_caching": {"limits": dataclasses.replace(tiny, enable_prefix_caching=False),
                              "allow_lone_oversized_prompt": True},
        "strict_budget": {"limits": _STRICT_LIMITS},
        "prompt_logprobs": {"limits": tiny, "allow_lone_oversized_prompt": True, "prompt_logprobs_every": 3},
    }

    def trace(options: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            check_resource_manager(factory, seed=seed, **options)
        return run

    checks = [Check(name, TRACE, trace(options)) for name, options in runs.items()]
    return run_checks(SEAM, plugin or getattr(factory, "__qualname__", "?"), checks, skip=skip)


def _make_traces(rng: random.Random, limits: KVLimits, num_requests: int, max_prompt_len: int | None,
                 max_new_tokens: int, arrival_spread: int | None, shared_prefix_prob: float,
                 vocab_size: int, prompt_logprobs_every: int) -> list[_Trace]:
    """Requests the engine would accept: ``prompt + max_tokens`` fits max_model_len and the pool."""
    longest = min(limits.max_model_len, limits.num_blocks * limits.block_size)
    if longest < 2:
        raise ValueError(f"limits {limits!r} leave no room for a prompt and one output token")
    prompt_cap = min(max_prompt_len or longest - 1, longest - 1)
    prefixes = [[rng.randrange(vocab_size) for _ in range(rng.randint(1, prompt_cap))] for _ in range(3)]
    spread = num_requests // 2 if arrival_spread is None else arrival_spread
    traces = []
    for i in range(num_requests):
        max_tokens = rng.randint(1, min(max_new_tokens, longest - 1))
        length = rng.randint(1, min(prompt_cap, longest - max_tokens))
        prompt = rng.choice(prefixes)[:length] if rng.random() < shared_prefix_prob else []
        prompt += [rng.randrange(vocab_size) for _ in range(length - len(prompt))]
        scored = prompt_logprobs_every and i % prompt_logprobs_every == 0
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=0 if scored else None)
        request = Request(f"req-{i}", prompt, params, arrival_time=float(i))
        traces.append(_Trace(rng.randint(0, spread), request))
    traces.sort(key=lambda t: t.arrival_step)
    return traces


class _Simulation:
    """The kit's own view of the manager's requests, to check each plan against."""

    def __init__(self, manager: ResourceManager, limits: KVLimits, seed: int, allow_oversized: bool) -> None:
        self.manager = manager
        self.limits = limits
        self.seed = seed
        self.allow_oversized = allow_oversized
        self.step = 0
        self.live: dict[str, Request] = {}       # added, not finished
        self.tables: dict[str, list[int]] = {}   # live request id -> its latest block table (holding blocks)
        self.computed: dict[str, int] = {}       # live request id -> computed tokens after its last row
        self.num_preemptions = 0
        self.num_aborted = 0
        self.max_rows = 0
        self.max_step_tokens = 0
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0

    def fail(self, message: str, invariant: str) -> None:
        raise broken(SEAM, invariant, f"{type(self.manager).__name__} (seed {self.seed}, step {self.step}): {message}")

    # --- engine actions ----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.manager.add_request(request)
        self.live[request.request_id] = request
        self.computed[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        """End one request between steps, as the engine core does on an abort."""
        request = self.live[request_id]
        self.finish([request], FinishReason.ABORT)
        self.num_aborted += 1
        self.manager.finish_requests([request], FinishReason.ABORT)   # a second end must change nothing
        self.check_blocks()

    def finish(self, requests: list[Request], reason: FinishReason) -> None:
        """End requests as the engine core does: the manager frees, then the core marks them."""
        self.manager.finish_requests(requests, reason)
        for request in requests:
            if request.status is RequestStatus.FINISHED:
                self.fail(f"{request!r}: finish_requests set FINISHED itself; the engine core owns that", CORE_FINISHES)
            request.status, request.finish_reason = RequestStatus.FINISHED, reason
            self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        del self.live[request_id]
        self.tables.pop(request_id, None)
        del self.computed[request_id]

    # --- checks ------------------------------------------------------------------------------

    def check_plan(self, plan: StepPlan) -> None:
        limits = self.limits
        rows = plan.scheduled
        total = sum(r.num_new_tokens for r in rows)
        self.max_rows = max(self.max_rows, len(rows))
        self.max_step_tokens = max(self.max_step_tokens, total)
        if len(rows) > limits.max_num_seqs:
            self.fail(f"{len(rows)} rows > max_num_seqs {limits.max_num_seqs}", BUDGETS)
        if plan.total_num_tokens != total:
            self.fail(f"plan.total_num_tokens {plan.total_num_tokens} != sum of rows {total}", BUDGETS)
        if total > limits.max_num_batched_tokens and not self._lone_whole_prompt(plan):
            self.fail(f"{total} tokens > max_num_batched_tokens {limits.max_num_batched_tokens}", BUDGETS)
        self._check_preempted(plan)
        seen: set[str] = set()
        for row in rows:
            rid = row.request.request_id
            if rid in seen:
                self.fail(f"{rid} has two rows", ROWS)
            seen.add(rid)
            if self.live.get(rid) is not row.request:
                self.fail(f"row for {rid}, which is not a live request", ROWS)
            self._check_row(row.request, row.start, row.num_new_tokens, row.block_table, row.sample)
            self.tables[rid] = list(row.block_table)
            self.computed[rid] = row.start + row.num_new_tokens

    def _lone_whole_prompt(self, plan: StepPlan) -> bool:
        if not self.allow_oversized or len(plan.scheduled) != 1:
            return False
        row = plan.scheduled[0]
        return row.start == 0 and row.num_new_tokens == row.request.num_tokens

    def _check_preempted(self, plan: StepPlan) -> None:
        scheduled = {r.request.request_id for r in plan.scheduled}
        for rid in plan.preempted_ids:
            request = self.live.get(rid)
            if request is None:
                self.fail(f"preempted id {rid!r} is not a live request", PREEMPTION)
            assert request is not None
            if rid in scheduled:
                self.fail(f"{rid} is both preempted and scheduled", PREEMPTION)
            if request.status is not RequestStatus.PREEMPTED or request.num_computed_tokens != 0:
                self.fail(f"preempted {request!r} is not PREEMPTED with 0 computed tokens", PREEMPTION)
            self.tables.pop(rid, None)
            self.computed[rid] = 0
            self.num_preemptions += 1

    def _check_row(self, request: Request, start: int, n: int, table: list[int], sample: bool) -> None:
        rid, bs = request.request_id, self.limits.block_size
        end = start + n
        if n < 1:
            self.fail(f"{rid}: num_new_tokens {n} < 1", ROWS)
        if request.status is not RequestStatus.RUNNING:
            self.fail(f"{rid} is scheduled but its status is {request.status.value}", ROWS)
        if request.num_computed_tokens != end:
            self.fail(f"{rid}: num_computed_tokens {request.num_computed_tokens} != start + new = {end}", ADVANCES)
        if end > request.num_tokens:
            self.fail(f"{rid}: row ends at {end}, past its {request.num_tokens} tokens", CONTINUES)
        if sample != (end == request.num_tokens):
            self.fail(f"{rid}: sample={sample} but the row ends at {end} of {request.num_tokens} tokens", CONTINUES)
        old = self.tables.get(rid)
        if old is not None:   # running since an earlier step: continue where it stopped
            if start != self.computed[rid]:
                self.fail(f"{rid}: row starts at {start}, its previous row ended at {self.computed[rid]}", CONTINUES)
            if table[:len(old)] != old:
                self.fail(f"{rid}: block table {table} does not extend its previous table {old}", TABLES)
        elif start != 0 and request.needs_prompt_logprobs:
            self.fail(f"{rid}: newly admitted at start {start}, but it needs prompt logprobs (no prefix-cache hits)",
                      PROMPT_LOGPROBS)
        elif start != 0 and not (self.limits.enable_prefix_caching and start % bs == 0 and start < request.num_tokens):
            self.fail(f"{rid}: newly admitted at start {start}, not 0 or a cached block boundary", CONTINUES)
        if len(table) * bs < end:
            self.fail(f"{rid}: {len(table)} blocks of {bs} cannot hold {end} tokens", TABLES)
        if len(set(table)) != len(table) or any(not 0 <= b < self.limits.num_blocks for b in table):
            self.fail(f"{rid}: block table {table} has duplicates or ids out of range", TABLES)

    def check_blocks(self) -> None:
        """Sharing only through prefix caching, and free + held == num_blocks."""
        owners: dict[int, list[tuple[Request, int]]] = {}
        for rid, table in self.tables.items():
            for pos, block in enumerate(table):
                owners.setdefault(block, []).append((self.live[rid], pos))
        bs = self.limits.block_size
        for block, holders in owners.items():
            if len(holders) == 1:
                continue
            names = [r.request_id for r, _ in holders]
            if not self.limits.enable_prefix_caching:
                self.fail(f"block {block} is held by {names} with prefix caching off", SHARING)
            pos = holders[0][1]
            end = (pos + 1) * bs
            first = holders[0][0]
            if any(p != pos or r.num_tokens < end or r.token_slice(0, end) != first.token_slice(0, end)
                   for r, p in holders):
                self.fail(f"block {block} is shared by {names} without a common prefix through it", SHARING)
        held = len(owners)
        free = self.manager.num_free_blocks()
        if free != self.limits.num_blocks - held:
            self.fail(f"num_free_blocks() is {free}, but live requests hold {held} of "
                      f"{self.limits.num_blocks} blocks (leak or double free)", NO_LEAKS)
        self._check_stats(free)

    def _check_stats(self, free: int) -> None:
        stats = self.manager.stats()
        running = sum(1 for r in self.live.values() if r.status is RequestStatus.RUNNING)
        expected = (self.limits.num_blocks, free, running, len(self.live) - running)
        got = (stats.num_blocks, stats.num_free_blocks, stats.num_running, stats.num_waiting)
        if got != expected:
            self.fail(f"stats (blocks, free, running, waiting) = {got}, expected {expected}", STATS)
        if stats.num_preemptions != self.num_preemptions:
            self.fail(f"stats.num_preemptions {stats.num_preemptions} != preempted ids seen {self.num_preemptions}",
                      STATS)
        if not (self._last_queries <= stats.prefix_cache_queries and self._last_hits <= stats.prefix_cache_hits
                and stats.prefix_cache_hits <= stats.prefix_cache_queries):
            self.fail(f"prefix cache counters went back or hits exceed queries: {stats!r}", STATS)
        if not self.limits.enable_prefix_caching and stats.prefix_cache_hits:
            self.fail(f"{stats.prefix_cache_hits} prefix cache hits with prefix caching off", STATS)
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if self.manager.has_unfinished() != bool(self.live):
            self.fail(f"has_unfinished() is {self.manager.has_unfinished()} with {len(self.live)} live requests", STATS)

    def check_drained(self, requests: list[Request]) -> None:
        unfinished = [r for r in requests if r.status is not RequestStatus.FINISHED or r.finish_reason is None]
        if unfinished:
            self.fail(f"after the drain {len(unfinished)} requests are not finished, e.g. {unfinished[0]!r}", DRAINED)
        if self.manager.num_free_blocks() != self.limits.num_blocks:
            self.fail(f"after the drain {self.manager.num_free_blocks()} of {self.limits.num_blocks} blocks are free",
                      DRAINED)
