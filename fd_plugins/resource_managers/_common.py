"""Request bookkeeping the built-in KV managers share: queues, block tables and their release.

State of a :class:`QueuedBlockManager` and its invariants:

* ``waiting`` — requests holding no blocks, admitted from the head (FIFO; a preempted request
  is put back at the head). Status WAITING or PREEMPTED.
* ``running`` — requests holding blocks, in admission order. Status RUNNING.
* ``tables`` — exactly one :class:`BlockTable` per running request and none for others.
* Every unfinished request is in exactly one of ``waiting`` / ``running``; finished requests are
  in neither and hold no blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fd_core.contracts.resource_manager import KVStats, ResourceManager
from fd_core.outputs import ScheduledRequest
from fd_core.request import RequestStatus

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fd_core.contracts.resource_manager import KVLimits
    from fd_core.request import FinishReason, Request
    from fd_plugins.resource_managers.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of ``b`` tokens needed for ``a`` tokens."""
    return -(-a // b)


@dataclass(slots=True)
class BlockTable:
    """The blocks one running request holds, in position order; ``ids[i] == blocks[i].block_id``."""

    blocks: list[KVBlock] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0     # leading blocks already registered in a prefix cache


class QueuedBlockManager(ResourceManager):
    """Queues, block tables and lifecycle; subclasses write ``schedule`` and admission."""

    supports_reserve: ClassVar[bool] = True

    def __init__(self, settings: BaseModel | None, *, limits: KVLimits, hooks: Any, pool: BlockPool) -> None:
        super().__init__(settings, limits=limits, hooks=hooks)
        assert pool.num_blocks == limits.num_blocks
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.tables: dict[str, BlockTable] = {}
        self._unfinished: dict[str, Request] = {}   # every request in waiting or running, by id
        self._num_preemptions = 0

    # --- the contract ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self._unfinished, f"{request!r} added twice"
        request.status = RequestStatus.WAITING
        self._unfinished[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> list[int] | None:
        assert request.request_id not in self._unfinished, f"{request!r} added twice"
        n_prompt = request.num_prompt_tokens
        assert not request.output_token_ids, "a reserved request gets its first token from the prefill side"
        needed = cdiv(n_prompt, self.limits.block_size)
        if needed > self.pool.num_free or len(self.running) >= self.limits.max_num_seqs:
            return None
        table = BlockTable()
        self.tables[request.request_id] = table
        self._grow(request, needed)
        self._unfinished[request.request_id] = request
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.admitted_time = time.time()
        request.num_computed_tokens = n_prompt
        return list(table.ids)

    def finish_requests(self, requests: list[Request], reason: FinishReason) -> None:
        done = [r for r in requests if self._unfinished.get(r.request_id) is r]
        for request in done:
            self._retire(request)
        ids = {r.request_id for r in done}
        if ids:
            self.running = [r for r in self.running if r.request_id not in ids]

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def stats(self) -> KVStats:
        return KVStats(num_blocks=self.num_blocks, num_free_blocks=self.pool.num_free,
                       num_running=len(self.running), num_waiting=len(self.waiting),
                       num_preemptions=self._num_preemptions)

    # --- helpers for subclasses --------------------------------------------------------------

    def _blocks_missing(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` must still get so that its table covers ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.limits.block_size) - len(self.tables[request.request_id].blocks))

    def _grow(self, request: Request, num_blocks: int) -> None:
        """Append ``num_blocks`` fresh blocks to the request's table (the caller checked room)."""
        table = self.tables[request.request_id]
        new = self.pool.allocate(num_blocks)
        table.blocks.extend(new)
        table.ids.extend(b.block_id for b in new)

    def _start_running(self, request: Request, table: BlockTable) -> None:
        """Move ``request`` from ``waiting`` to the tail of ``running`` with ``table``."""
        self.waiting.remove(request)
        self.tables[request.request_id] = table
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.admitted_time = time.time()

    def _row(self, request: Request, num_new_tokens: int, now: float) -> ScheduledRequest:
        """Plan ``num_new_tokens`` tokens of ``request`` (its proposed tokens may follow the known ones)
        and advance its computed count at once."""
        start = request.num_computed_tokens
        end = start + num_new_tokens
        ids = self.tables[request.request_id].ids
        assert (num_new_tokens >= 1 and end <= request.num_tokens_with_spec
                and len(ids) * self.limits.block_size >= end)
        request.num_computed_tokens = end
        if request.scheduled_time is None:
            request.scheduled_time = now
        return ScheduledRequest(request, start, num_new_tokens, ids.copy(), sample=end >= request.num_tokens)

    def _release(self, request: Request) -> None:
        """Give back every block of ``request`` (tail first) if it holds any."""
        table = self.tables.pop(request.request_id, None)
        if table is not None:
            self.pool.free(table.blocks[::-1])

    def _retire(self, request: Request) -> None:
        """Free the request's blocks and drop it from ``waiting``; the core marks it finished.

        The caller removes it from ``running`` (finish_requests does so in one pass).
        """
        self._release(request)
        del self._unfinished[request.request_id]
        if request.status is not RequestStatus.RUNNING:
            self.waiting.remove(request)
