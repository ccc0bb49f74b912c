"""One workload, one machine, one run: one instance; two instances sharing Redis (every request
sent to the first); ``data_parallel_size = 2``; a prefill + decode pair over each connector
(requests sent to the decode instance). Prints a markdown table, saves JSON.

    python benchmarks/cluster.py --json-out benchmarks/results/cluster.json

Starts its own redis-server and fd-serve processes on 127.0.0.1 (the default model unless
``--model``) and stops them. Per setup: output tok/s, TTFT p50/p99, and Redis round trips per
request (both instances' ``fd_scheduler_redis_round_trips_total`` over the timed run, divided
by its requests). For the prefill/decode pairs also the KV transfer: bytes the decode side
received over the time from each hand-off's first block arriving to its last (MB/s), and that
time per 1k prompt tokens. Each setup gets a short warm-up first. On a 2-core machine the two
instances compete for the same cores, and each dp rank gets one core: reported as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from fd_core.bench.serve import model_card, run_benchmark, summarize
from fd_core.bench.workload import make_workload
from fd_core.testing.redis_server import RedisServer


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, args: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "fd_core.cli", "--server.port", self.url.rsplit(":", 1)[1],
                                      *args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fd-serve exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError("fd-serve did not start")

    def figure(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        self._log.close()


def _pool_config(folder: Path, url: str, name: str) -> str:
    path = folder / f"{name}.toml"
    path.write_text(f'[scheduler]\nname = "global"\n[scheduler.options]\nurl = "{url}"\n')
    return str(path)


def _split_args(folder: Path, url: str, connector: str) -> list[list[str]]:
    """fd-serve arguments of a prefill and a decode instance pairing through ``url``."""
    options = f'{{"url": "{url}", "topic": "bench-{connector}"}}'
    return [["--splitwise.role", role, "--scheduler.name", "splitwise", "--scheduler.options", options,
             "--connector.name", connector] for role in ("prefill", "decode")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--setups", default="single,pool,dp2,pd-zmq,pd-shm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    common = ["--model.source", args.model, "--server.max_concurrency", "256"]
    folder = Path(tempfile.mkdtemp(prefix="fd-cluster-bench-"))
    rows: dict[str, dict] = {}
    with RedisServer(folder / "redis") as redis:
        setups = {"single": [common], "pool": [common + ["--config", _pool_config(folder, redis.url, n)]
                                               for n in ("a", "b")],
                  "dp2": [common + ["--parallel.data_parallel_size", "2"]],
                  **{f"pd-{c}": [common + extra for extra in _split_args(folder, redis.url, c)]
                     for c in ("zmq", "shm")}}
        for name in args.setups.split(","):
            with ExitStack() as stack:
                servers = []
                for i, server_args in enumerate(setups[name]):
                    server = _Server(server_args, folder / f"{name}-{i}.log")
                    stack.callback(server.stop)
                    servers.append(server)
                url = servers[-1].url   # the decode instance of a pair
                card = model_card(url, None)
                workload = make_workload(num_prompts=args.num_prompts, input_len=args.input_len,
                                         output_len=args.output_len, range_ratio=0.0,
                                         vocab_size=card["vocab_size"], seed=args.seed)

                def run(items: list, url: str = url, card: dict = card) -> dict:
                    results, duration = asyncio.run(run_benchmark(
                        base_url=url, model=card["id"], workload=items, request_rate=float("inf"), burstiness=1.0,
                        max_concurrency=args.max_concurrency, seed=args.seed, api_key=None))
                    return summarize(results, duration)

                run(workload[:4])   # warm-up
                names = ("fd_scheduler_redis_round_trips_total", "fd_scheduler_served_for_peers_total",
                         "fd_splitwise_bytes_received_total", "fd_splitwise_kv_receive_us_total",
                         "fd_splitwise_kv_prompt_tokens_total")

                def totals(servers: list = servers, names: tuple = names) -> list[float]:
                    return [sum(s.figure(n) for s in servers) for n in names]

                before = totals()
                summary = run(workload)
                trips, peers, kv_bytes, kv_us, kv_tokens = (a - b for a, b in zip(totals(), before, strict=True))
                summary["redis_round_trips_per_request"] = trips / max(1, summary["completed"])
                summary["served_by_a_peer"] = peers
                if kv_tokens:
                    summary["kv_transfer_mb_per_s"] = kv_bytes / 1e6 / max(kv_us / 1e6, 1e-9)
                    summary["kv_transfer_ms_per_1k_prompt_tokens"] = kv_us / 1e3 / (kv_tokens / 1000)
                rows[name] = summary
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"{args.model}: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"max concurrency {args.max_concurrency}; CPU: {cpu}\n")
    print("| setup | ok | served by a peer | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
          "Redis round trips / request | KV MB/s | KV ms / 1k prompt tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in rows.items():
        kv = (f"{s['kv_transfer_mb_per_s']:.0f} | {s['kv_transfer_ms_per_1k_prompt_tokens']:.1f}"
              if "kv_transfer_mb_per_s" in s else "– | –")
        print(f"| {name} | {s['completed']} | {s['served_by_a_peer']:.0f} | {s['output_throughput']:.1f} | "
              f"{s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | {s['median_tpot_ms']:.0f} | "
              f"{s['redis_round_trips_per_request']:.1f} | {kv} |")
    if args.json_out:
        args.json_out.write_text(json.dumps({"cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()},
                                             "setups": rows}, indent=2))


if __name__ == "__main__":
    main()
