"""RMSNorm cost per decode step of the default model: each kernel variant this host may run.

A decode step of SmolLM2-135M runs ``2 * 30 + 1`` RMSNorms (two per layer, with the residual
add, plus the final norm on the sampled rows) over ``[rows, 576]``. For every variant in
``fd_core.model.kernels`` whose capabilities the cpu platform declares here, this times one
call (median of ``--repeats`` batches of ``--calls`` calls, after a warm-up) and reports the
cost of a step's norms in milliseconds. Variants the platform does not declare are listed as
skipped with the reason, never run (Paddle's fused kernel dies with SIGILL without AVX-512).

    python benchmarks/rms_norm_cost.py --json-out /tmp/rms_norm_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HIDDEN = 576
NORMS_PER_STEP = 2 * 30 + 1


def time_call(fn, args: tuple, *, calls: int, repeats: int) -> float:
    """Median seconds per call."""
    for _ in range(10):
        fn(*args)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,32,128", help="decode rows per step")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    import paddle

    from fd_core.model.kernels import KERNEL_VARIANTS
    from fd_plugins.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    paddle.base.core.set_num_threads(platform.num_threads())
    weight = paddle.rand([HIDDEN])
    results: dict = {"cpu": platform.features.describe(), "threads": platform.num_threads(),
                     "norms_per_step": NORMS_PER_STEP, "ms_per_step": {}, "skipped": {}}
    for variant in KERNEL_VARIANTS["rms_norm"]:
        missing = variant.requires - platform.capabilities
        if missing:
            results["skipped"][variant.name] = f"the cpu platform does not declare {' '.join(sorted(missing))}"
            continue
        per_rows = {}
        for rows in (int(r) for r in args.rows.split(",")):
            x, residual = paddle.randn([rows, HIDDEN]), paddle.randn([rows, HIDDEN])
            per_call = time_call(variant.fn, (x, weight, 1e-5, residual), calls=args.calls, repeats=args.repeats)
            per_rows[rows] = per_call * NORMS_PER_STEP * 1e3
        results["ms_per_step"][variant.name] = per_rows

    print(f"CPU: {results['cpu']} ({results['threads']} threads)")
    print(f"RMSNorm per decode step ({NORMS_PER_STEP} norms of [rows, {HIDDEN}]), ms:")
    for name, per_rows in results["ms_per_step"].items():
        print(f"  {name:<9}" + "".join(f"  rows={rows}: {ms:7.2f}" for rows, ms in per_rows.items()))
    for name, why in results["skipped"].items():
        print(f"  {name:<9}  skipped: {why}")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
