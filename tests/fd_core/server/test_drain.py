"""The shutdown deadline: waits in a scope fail with the documented 503 once it passes, others are untouched."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest

from fd_core.server.drain import Drain
from fd_core.server.http_errors import SHUTTING_DOWN, ApiError


async def ticks(period: float) -> AsyncIterator[int]:
    count = 0
    while True:
        await asyncio.sleep(period)
        count += 1
        yield count


def test_a_wait_in_progress_fails_when_the_deadline_passes():
    async def run() -> ApiError:
        drain = Drain(0.05)
        asyncio.get_running_loop().call_soon(drain.start)
        with pytest.raises(ApiError) as info:
            async with drain.scope():
                await asyncio.sleep(30)
        if sys.version_info >= (3, 11):  # the cancellation was ours and is spent
            assert asyncio.current_task().cancelling() == 0
        return info.value

    error = asyncio.run(run())
    assert error.status == 503 and error.code == SHUTTING_DOWN
    assert "server.shutdown_timeout_s (0.05 s) ran out" in error.message


def test_a_stream_fails_at_the_deadline_even_when_its_items_are_always_ready():
    async def ready() -> AsyncIterator[int]:
        for i in range(10**9):
            yield i  # never suspends

    async def run() -> int:
        drain = Drain(0)
        seen = 0
        with pytest.raises(ApiError):
            async for _ in drain.iterate(ready()):
                seen += 1
                if seen == 5:
                    drain.start()
                await asyncio.sleep(0)  # sending the item
        return seen

    assert asyncio.run(run()) == 5


def test_nothing_fails_before_the_drain_starts_or_outside_a_scope():
    async def run() -> list[int]:
        drain = Drain(0)
        got = []
        async for item in drain.iterate(ticks(0.001)):
            got.append(item)
            if len(got) == 3:
                break
        drain.start()
        await asyncio.sleep(0.01)  # outside any scope: not cancelled
        return got

    assert asyncio.run(run()) == [1, 2, 3]
