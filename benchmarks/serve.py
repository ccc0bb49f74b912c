"""Run ``fd-bench serve`` at several max-concurrency levels against one server and print a markdown table.

    fd-serve &                                    # the default model on 127.0.0.1:8000
    python benchmarks/serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32 --json-out serve.json

Each level uses the same seeded workload (``--num-prompts``, ``--input-len``, ``--output-len``);
a short warm-up run goes first so the first level does not pay for the server's first batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from fd_core.bench.serve import model_card, run_benchmark, summarize
from fd_core.bench.workload import make_workload

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    card = model_card(args.url, None)
    workload = make_workload(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                             range_ratio=0.0, vocab_size=card["vocab_size"], seed=args.seed)

    def run(items: list, concurrency: int) -> dict:
        results, duration = asyncio.run(run_benchmark(
            base_url=args.url, model=card["id"], workload=items, request_rate=float("inf"), burstiness=1.0,
            max_concurrency=concurrency, seed=args.seed, api_key=None))
        return summarize(results, duration)

    run(workload[:4], 4)  # warm-up
    rows = {int(c): run(workload, int(c)) for c in args.concurrency.split(",")}
    print(f"{card['id']}: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len} tokens\n")
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
