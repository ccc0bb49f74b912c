"""Run ``fd-bench serve`` at several max-concurrency levels against one server and print a markdown table.

    fd-serve &                                    # the default model on 127.0.0.1:8000
    python benchmarks/serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32 --json-out serve.json

Each level sends its own ``--num-prompts`` prompts (``--input-len``, ``--output-len``), drawn
from one seeded workload: prompts already sent would hit the server's prefix cache, and the
figures would measure cache reuse rather than prefill. ``--reuse-prompts`` sends the same prompts
at every level instead, to measure a warm prefix cache. A short warm-up run on prompts of its own
goes first, so the first level does not pay for the server's first batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from fd_core.bench.serve import model_card, run_benchmark, summarize
from fd_core.bench.workload import make_workload

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
WARM_UP_PROMPTS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse-prompts", action="store_true",
                        help="send the same prompts at every level (measures prefix-cache hits)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    card = model_card(args.url, None)
    levels = [int(c) for c in args.concurrency.split(",")]
    batches = 1 if args.reuse_prompts else len(levels)
    workload = make_workload(num_prompts=WARM_UP_PROMPTS + args.num_prompts * batches, input_len=args.input_len,
                             output_len=args.output_len, range_ratio=0.0, vocab_size=card["vocab_size"],
                             seed=args.seed)
    warm_up, prompts = workload[:WARM_UP_PROMPTS], workload[WARM_UP_PROMPTS:]

    def level_prompts(index: int) -> list:
        start = 0 if args.reuse_prompts else index * args.num_prompts
        return prompts[start:start + args.num_prompts]

    def run(items: list, concurrency: int) -> dict:
        results, duration = asyncio.run(run_benchmark(
            base_url=args.url, model=card["id"], workload=items, request_rate=float("inf"), burstiness=1.0,
            max_concurrency=concurrency, seed=args.seed, api_key=None))
        return summarize(results, duration)

    run(warm_up, WARM_UP_PROMPTS)
    rows = {concurrency: run(level_prompts(index), concurrency) for index, concurrency in enumerate(levels)}
    fresh = "the same prompts at every level" if args.reuse_prompts else "fresh prompts per level"
    print(f"{card['id']}: {args.num_prompts} prompts ({fresh}), input {args.input_len}, "
          f"output {args.output_len} tokens\n")
    print("| max conc. | ok | req/s | out tok/s | total tok/s | "
          + " | ".join(f"{label} mean/p50/p90/p99 ms" for _, label in LATENCIES) + " |")
    print("|---" * (5 + len(LATENCIES)) + "|")
    for concurrency, s in rows.items():
        cells = [str(concurrency), str(s["completed"]), f"{s['request_throughput']:.2f}",
                 f"{s['output_throughput']:.1f}", f"{s['total_token_throughput']:.1f}"]
        cells += [" / ".join(f"{s[f'{p}_{key}_ms']:.0f}" for p in ("mean", "median", "p90", "p99"))
                  for key, _ in LATENCIES]
        print("| " + " | ".join(cells) + " |")
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": card["id"], "args": {k: str(v) for k, v in vars(args).items()},
                                             "levels": rows}, indent=2))


if __name__ == "__main__":
    main()
