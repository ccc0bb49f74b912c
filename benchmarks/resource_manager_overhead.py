"""Measures the host time of ``ResourceManager.schedule()`` alone with N requests decoding.

    python benchmarks/resource_manager_overhead.py [--running 64 256] [--steps 500]

Each request has a 128-token prompt (distinct, so prefix caching finds nothing) and is
prefilled first; then every timed step plans one decode token per request. Sampling, i.e.
appending a token to each row, is done outside the timed region. Prints µs per step, median
and p90, for v0 and v1 (prefix caching on and off).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from fd_core.contracts.resource_manager import KVLimits, ResourceManager
from fd_core.registry import Registry
from fd_core.request import Request, SamplingParams
from fd_plugins.resource_managers.v0 import V0ResourceManager
from fd_plugins.resource_managers.v1.manager import V1ResourceManager

PROMPT_LEN = 128
BLOCK_SIZE = 16


def _decode_step_times(manager: ResourceManager, num_running: int, steps: int) -> list[float]:
    requests = [Request(f"r{i}", [i] * PROMPT_LEN, SamplingParams(max_tokens=steps + 8))
                for i in range(num_running)]
    for request in requests:
        manager.add_request(request)
    while any(r.num_computed_tokens < PROMPT_LEN for r in requests):   # prefill everything
        for row in manager.schedule().scheduled:
            if row.sample:
                row.request.output_token_ids.append(1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        plan = manager.schedule()
        times.append(time.perf_counter() - start)
        assert len(plan.scheduled) == num_running and plan.total_num_tokens == num_running
        for row in plan.scheduled:
            row.request.output_token_ids.append(1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    hooks = Registry.from_plugins({}).hooks
    variants = [("v0", V0ResourceManager, False), ("v1", V1ResourceManager, False),
                ("v1+prefix", V1ResourceManager, True)]
    for n in args.running:
        blocks_per_request = -(-(PROMPT_LEN + args.steps + 8) // BLOCK_SIZE) + 1
        limits = KVLimits(num_blocks=n * blocks_per_request, block_size=BLOCK_SIZE, max_num_seqs=n,
                          max_num_batched_tokens=max(2048, n), max_model_len=4096,
                          enable_prefix_caching=False)
        for label, cls, prefix in variants:
            manager = cls(None, limits=dataclasses.replace(limits, enable_prefix_caching=prefix), hooks=hooks)
            times = sorted(_decode_step_times(manager, n, args.steps))
            median = statistics.median(times) * 1e6
            p90 = times[int(0.9 * len(times))] * 1e6
            print(f"{label:10s} running={n:4d}  schedule(): median {median:7.1f} us  p90 {p90:7.1f} us  "
                  f"({median / n:.2f} us/request)")


if __name__ == "__main__":
    main()
