"""Data parallelism behind one front end: N engine processes (ranks), requests placed by load.

``parallel.data_parallel_size = N`` makes the server use a :class:`DataParallelClient` instead
of one :class:`~fd_core.server.engine_client.EngineClient`; it has the same surface. Each rank
is a whole engine (its own KV pool, scheduler, runner) pinned to its share of the CPUs, so N
ranks on N cores do not fight over them; the shares follow the host's L3 and NUMA domains
(:mod:`fd_core.server.rank_placement`). The requests of one call (the ``n`` choices, or several
prompts) go to the rank with the fewest tokens in flight (prompt + ``max_tokens`` of each
request placed there and not finished); its outputs come back on that rank's stream.

A rank that dies does not lose its requests, even those it had not acknowledged yet: each open
stream is re-homed on the live rank with the fewest tokens in flight, its unfinished requests sent
there as *continuations* (the output tokens the client already has are pre-filled; the new rank
recomputes their KV and the token processor replays them silently), so the client's stream goes
on with no duplicate and no gap. Only with no live rank left do they fail, naming the rank and how
it died; a rank that refuses a continuation fails its stream with the reason.

A rank's load is always recomputed from the live placements; a placement ends when its holder's
final output arrives, or when the holder refuses or loses the request. What a former holder says
about a request later (a dead rank's outputs read late) is dropped. The surviving ranks
keep serving and ``/health`` says ``degraded``; when every rank is dead the engine is dead (the
server then exits for its supervisor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fd_core.errors import EngineDeadError, RequestError
from fd_core.host_topology import read_host_topology
from fd_core.request import RequestStatus
from fd_core.server.engine_client import EngineClient, EngineStartError, EngineState
from fd_core.server.rank_placement import cpu_shares, describe_shares

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.outputs import RequestOutput
    from fd_core.request import Request
    from fd_core.server.engine_client import RequestStream

log = logging.getLogger(__name__)


class DataParallelClient:
    """N :class:`EngineClient` ranks as one; every method runs on the server's event loop."""

    def __init__(self, config: FdConfig, *, log_level: str = "INFO",
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        size = config.parallel.data_parallel_size
        assert isinstance(size, int), "resolve 'auto' first (rank_placement.resolve_data_parallel_size)"
        self._topology = read_host_topology()
        shares = cpu_shares(self._topology, size)
        self.config = config
        self._on_finished = on_finished
        self._on_dead = on_dead
        self.ranks = [EngineClient(config, log_level=log_level, on_finished=functools.partial(self._finished, rank),
                                   on_dead=self._rank_died, name=f"data-parallel rank {rank}", cpus=shares[rank],
                                   rescue=self._rescue)
                      for rank in range(size)]
        self.cpu_shares = shares
        self._placed: dict[str, _Placed] = {}
        #: Requests continued on another rank after theirs died (for /metrics).
        self.num_rescued = 0

    # --- the EngineClient surface --------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        states = {rank.state for rank in self.ranks}
        for state in (EngineState.READY, EngineState.STARTING, EngineState.DEAD):
            if state in states:
                return state
        return EngineState.STOPPED

    @property
    def dead_reason(self) -> str | None:
        reasons = [rank.dead_reason for rank in self.ranks if rank.dead_reason]
        return "; ".join(reasons) or None

    @property
    def stage(self) -> str:
        starting = [rank for rank in self.ranks if rank.state is EngineState.STARTING]
        return "; ".join(f"{rank.name}: {rank.stage}" for rank in starting) or "ready"

    @property
    def info(self) -> dict[str, Any]:
        return next((rank.info for rank in self.ranks if rank.info), {})

    async def start(self, timeout: float) -> None:
        """Start every rank at once; any rank failing to start fails the whole start."""
        results = await asyncio.gather(*(rank.start(timeout) for rank in self.ranks), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed if isinstance(failed, EngineStartError) else EngineStartError(str(failed))
        log.info("%d data-parallel ranks ready: %s", len(self.ranks), describe_shares(self._topology, self.cpu_shares))

    async def shutdown(self) -> None:
        await asyncio.gather(*(rank.shutdown() for rank in self.ranks))

    async def add(self, requests: list[Request]) -> RequestStream:
        """Queue ``requests`` on the live rank with the fewest tokens in flight."""
        rank = self._least_loaded()
        if rank is None:
            raise self._unavailable()
        in_use = next((r.request_id for r in requests if r.request_id in self._placed), None)
        if in_use is not None:
            raise RequestError("request_id", f"request id {in_use!r} is already in use by a live request")
        for request in requests:   # counted before the await: concurrent calls see this load
            self._place(request, rank)
        try:
            return await self.ranks[rank].add(requests)
        except BaseException:
            for request in requests:
                self._unplace(request.request_id, rank)
            raise

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            placed = self._placed.get(request_id)
            if placed is not None:
                self.ranks[placed.rank].abort([request_id])

    def drain(self) -> None:
        for rank in self.ranks:
            rank.drain()

    async def stats(self) -> dict[str, Any]:
        """The live ranks' EngineStats summed, with ``ranks``: each rank's own figures."""
        live = [rank for rank in self.ranks if rank.state is EngineState.READY]
        if not live:
            raise self._unavailable()
        per_rank = await asyncio.gather(*(rank.stats() for rank in live))
        merged = _sum_stats(per_rank)
        by_rank = dict(zip((self.ranks.index(rank) for rank in live), per_rank, strict=True))
        merged["num_rescued"] = self.num_rescued
        loads = self._loads()
        merged["ranks"] = [{"rank": i, "up": int(i in by_rank), "tokens_in_flight": loads[i],
                            **({"kv": by_rank[i]["kv"], "generation_tokens": by_rank[i]["num_generated_tokens"]}
                               if i in by_rank else {})} for i in range(len(self.ranks))]
        dead = [rank.dead_reason for rank in self.ranks if rank.state is EngineState.DEAD]
        if dead:
            scheduler = merged.setdefault("scheduler", {})
            scheduler["degraded_reason"] = "; ".join(filter(None, [scheduler.get("degraded_reason"), *dead]))
        return merged

    # --- internals -----------------------------------------------------------------------------

    def _unavailable(self) -> EngineDeadError:
        if self.state is EngineState.STARTING:
            return EngineDeadError("the engine is starting; retry shortly")
        return EngineDeadError(self.dead_reason or "the engine is stopped")

    def _loads(self) -> list[int]:
        """Tokens in flight per rank: the sum over the requests placed there now."""
        loads = [0] * len(self.ranks)
        for placed in self._placed.values():
            loads[placed.rank] += placed.tokens
        return loads

    def _least_loaded(self) -> int | None:
        live = [i for i, rank in enumerate(self.ranks) if rank.state is EngineState.READY]
        loads = self._loads()
        return min(live, key=lambda i: loads[i]) if live else None

    def _place(self, request: Request, rank: int) -> None:
        """Place ``request`` on ``rank`` (replacing where it was placed before)."""
        self._placed[request.request_id] = _Placed(
            request, rank, request.num_prompt_tokens + request.sampling_params.max_tokens)

    def _unplace(self, request_id: str, rank: int) -> None:
        """End ``request_id``'s placement if ``rank`` holds it; a former holder no longer speaks for it."""
        placed = self._placed.get(request_id)
        if placed is not None and placed.rank == rank:
            del self._placed[request_id]

    def _finished(self, rank: int, output: RequestOutput) -> None:
        self._unplace(output.request_id, rank)
        if self._on_finished is not None:
            self._on_finished(output)

    def _rescue(self, stream: RequestStream) -> bool:
        """A rank died under ``stream``: continue its open requests on a live rank (True), if any."""
        rank = self._least_loaded()
        if rank is None:
            return False
        continuations = []
        for request_id in sorted(stream.open_ids):
            placed = self._placed.get(request_id)
            if placed is None:
                return False
            original = placed.request
            continuations.append(dataclasses.replace(
                original, output_token_ids=list(stream.delivered[request_id]), status=RequestStatus.WAITING,
                num_computed_tokens=0, num_cached_tokens=0))
        for request in continuations:
            self._place(request, rank)
        ids = [request.request_id for request in continuations]
        self.ranks[rank].adopt(stream, continuations, on_refused=functools.partial(self._unplace_all, ids, rank))
        self.num_rescued += len(continuations)
        log.warning("continuing %d requests on data-parallel rank %d", len(continuations), rank)
        return True

    def _unplace_all(self, request_ids: list[str], rank: int) -> None:
        for request_id in request_ids:
            self._unplace(request_id, rank)

    def _rank_died(self, reason: str) -> None:
        for request_id, placed in list(self._placed.items()):
            if self.ranks[placed.rank].state is EngineState.DEAD:
                del self._placed[request_id]
        if self.state is EngineState.DEAD:
            if self._on_dead is not None:
                self._on_dead(self.dead_reason or reason)
        else:
            log.error("%s; the other data-parallel ranks keep serving", reason)


@dataclasses.dataclass(slots=True)
class _Placed:
    """A request placed on a rank: the request as sent (to continue it elsewhere) and its tokens."""

    request: Request
    rank: int
    tokens: int   # prompt + max_tokens: its share of the rank's load


def _sum_hook_figures(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (hook, plugin) figures of several ranks, summed."""
    summed: dict[tuple[str, str], dict[str, Any]] = {}
    for item in figures:
        total = summed.setdefault((item["hook"], item["plugin"]), {"hook": item["hook"], "plugin": item["plugin"],
                                                                   "calls": 0, "errors": 0, "seconds": 0.0})
        for key in ("calls", "errors", "seconds"):
            total[key] += item[key]
    return list(summed.values())


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key (nested dicts too; the traced ``hooks`` by hook and plugin);
    anything else keeps the first value not None."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key == "hooks":
                merged[key] = _sum_hook_figures(merged.get(key, []) + value)
            elif isinstance(value, dict):
                merged[key] = _sum_stats([merged.get(key, {}), value])
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key in merged:
                merged[key] += value
            elif merged.get(key) is None:
                merged[key] = value
    return merged
