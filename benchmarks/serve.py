"""Run ``fd-bench serve`` at several max-concurrency levels against one server and print a markdown table.

    fd-serve &                                    # the default model on 127.0.0.1:8000
    python benchmarks/serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32 --json-out serve.json

Each level sends its own ``--num-prompts`` prompts (``--input-len``, ``--output-len``), drawn
from one seeded workload: prompts already sent would hit the server's prefix cache, and the
figures would measure cache reuse rather than prefill. ``--reuse-prompts`` sends the same prompts
at every level instead, to measure a warm prefix cache. A short warm-up run on prompts of its own
goes first, so the first level does not pay for the server's first batch.

Where the served time goes, per level, from the server's ``/metrics`` before and after it: the
front end's CPU (``process_cpu_seconds_total``, in cores), the engine processes' CPU
(``fd_engine_cpu_seconds_total``), the share of the wall time the engine was busy with a batch
and how much of that was the model runner; and this client's own CPU (it shares the cores).
A server without a figure (another engine's) shows "-".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import httpx

from fd_core.bench.serve import model_card, run_benchmark, summarize
from fd_core.bench.workload import make_workload

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
WARM_UP_PROMPTS = 4
#: The server's time counters read around each level: label -> metric name.
SERVER_TIMES = {"frontend_cpu": "process_cpu_seconds_total", "engine_cpu": "fd_engine_cpu_seconds_total",
                "engine_busy": "fd_engine_busy_seconds_total", "engine_runner": "fd_engine_runner_seconds_total"}


def server_times(url: str) -> dict[str, float]:
    """The counters of :data:`SERVER_TIMES` that the server's ``/metrics`` has (none without it)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = {label: re.search(rf"^{name} (\S+)$", text, re.MULTILINE) for label, name in SERVER_TIMES.items()}
    return {label: float(match.group(1)) for label, match in found.items() if match}


def time_shares(before: dict[str, float], after: dict[str, float], client_cpu: float, duration: float
                ) -> dict[str, float]:
    """CPU in cores (seconds per wall second) of the front end, engine and client; the engine's busy
    share of the wall time; the runner's share of that; the front end's share of the server's CPU."""
    spent = {label: after[label] - before[label] for label in after if label in before}
    shares = {f"{label}_cores": spent[label] / duration for label in ("frontend_cpu", "engine_cpu") if label in spent}
    shares["client_cpu_cores"] = client_cpu / duration
    if "engine_busy" in spent:
        shares["engine_busy_share"] = spent["engine_busy"] / duration
        shares["runner_share_of_busy"] = spent["engine_runner"] / max(spent["engine_busy"], 1e-9)
    if "frontend_cpu" in spent and "engine_cpu" in spent:
        shares["frontend_share_of_server_cpu"] = spent["frontend_cpu"] / (spent["frontend_cpu"] + spent["engine_cpu"])
    return shares


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
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="for a server whose model card lacks it (vllm serve: 49152 for SmolLM2)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    card = model_card(args.url, None)
    levels = [int(c) for c in args.concurrency.split(",")]
    batches = 1 if args.reuse_prompts else len(levels)
    workload = make_workload(num_prompts=WARM_UP_PROMPTS + args.num_prompts * batches, input_len=args.input_len,
                             output_len=args.output_len, range_ratio=0.0,
                             vocab_size=args.vocab_size or card["vocab_size"], seed=args.seed)
    warm_up, prompts = workload[:WARM_UP_PROMPTS], workload[WARM_UP_PROMPTS:]

    def level_prompts(index: int) -> list:
        start = 0 if args.reuse_prompts else index * args.num_prompts
        return prompts[start:start + args.num_prompts]

    def run(items: list, concurrency: int) -> dict:
        before, client_started = server_times(args.url), time.process_time()
        results, duration = asyncio.run(run_benchmark(
            base_url=args.url, model=card["id"], workload=items, request_rate=float("inf"), burstiness=1.0,
            max_concurrency=concurrency, seed=args.seed, api_key=None))
        client_cpu = time.process_time() - client_started
        return {**summarize(results, duration),
                **time_shares(before, server_times(args.url), client_cpu, duration)}

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
    print("\nwhere the time went (CPU in cores; busy: share of the wall time the engine ran a batch)\n")
    print("| max conc. | front end CPU | engine CPU | client CPU | engine busy | runner share of busy | "
          "front end share of server CPU |")
    print("|---" * 7 + "|")
    for concurrency, s in rows.items():
        cells = [f"{s[key]:.2f}" if key in s else "-" for key in (
            "frontend_cpu_cores", "engine_cpu_cores", "client_cpu_cores", "engine_busy_share",
            "runner_share_of_busy", "frontend_share_of_server_cpu")]
        print(f"| {concurrency} | " + " | ".join(cells) + " |")
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": card["id"], "args": {k: str(v) for k, v in vars(args).items()},
                                             "levels": rows}, indent=2))


if __name__ == "__main__":
    main()
