"""``fd-bench serve``: load-test a running OpenAI-compatible server the way ``vllm bench serve`` does.

Workload: ``--num-prompts`` requests whose input and output lengths are drawn uniformly from
``[len * (1 - range_ratio), len * (1 + range_ratio)]`` and whose prompts are random token ids
(all seeded by ``--seed``), sent as the ``prompt`` of ``/v1/completions`` so the server sees
exactly that many tokens; ``ignore_eos`` makes every request produce its full output length.
Requests start at ``--request-rate`` per second (Poisson, or gamma with ``--burstiness``;
``inf`` sends them all at once), at most ``--max-concurrency`` at a time.

Per request, with ``st`` taken just before sending (vLLM's definitions):

- TTFT = first streamed chunk - st;  E2EL = last chunk - st;
- TPOT = (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL = gaps between consecutive chunks, **per token**: a chunk carrying k tokens (known from
  ``stream_options.continuous_usage_stats``) contributes k gaps of gap / k. fd-serve sends one
  chunk per token, so this equals vLLM's per-chunk ITL; ``mean_tokens_per_chunk`` shows it.

Aggregates exclude failed requests: request throughput = completed / duration, output tok/s
= sum(out) / duration, total tok/s = (sum(in) + sum(out)) / duration, and SGLang's
concurrency = sum(E2EL) / duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from fd_core.bench.workload import WorkItem, make_workload

#: Percentiles reported for each latency metric.
PERCENTILES: Final = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)   # per token
    num_chunks: int = 0


def arrival_delays(n: int, *, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive request starts (all zero when the rate is infinite)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed + 1)
    theta = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n).tolist()


async def send_request(client: Any, url: str, payload: dict[str, Any]) -> RequestResult:
    """Stream one completion and time its chunks."""
    result = RequestResult(prompt_len=len(payload["prompt"]))
    tokens_so_far = 0
    st = time.perf_counter()
    last = st
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.success = not result.error
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    continue
                now = time.perf_counter()
                usage = chunk.get("usage") or {}
                if chunk.get("choices"):
                    new_tokens = usage.get("completion_tokens", tokens_so_far + 1) - tokens_so_far
                    tokens_so_far += new_tokens
                    result.num_chunks += 1
                    if result.num_chunks == 1:
                        result.ttft = now - st
                    elif new_tokens > 0:
                        result.itl.extend([(now - last) / new_tokens] * new_tokens)
                    last = now
                if usage:
                    result.output_len = usage["completion_tokens"]
                    result.prompt_len = usage["prompt_tokens"]
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2el = last - st
    return result


async def run_benchmark(*, base_url: str, model: str, workload: list[WorkItem], request_rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int,
                        api_key: str | None) -> tuple[list[RequestResult], float]:
    """Send the workload; returns every request's result and the benchmark duration."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(workload)
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    def payload(item: WorkItem) -> dict[str, Any]:
        return {"model": model, "prompt": item.prompt, "max_tokens": item.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=headers) as client:
        # The probe sends one token of the first prompt: the whole prompt would sit in the server's
        # prefix cache and make the first timed request look faster than the rest.
        probe_item = WorkItem(workload[0].prompt[:1], 2)
        probe = await send_request(client, url, payload(probe_item))
        if not probe.success:
            raise SystemExit(f"fd-bench serve: the test request failed: {probe.error}")

        async def limited(item: WorkItem) -> RequestResult:
            async with semaphore:
                return await send_request(client, url, payload(item))

        tasks = []
        start = time.perf_counter()
        delays = arrival_delays(len(workload), request_rate=request_rate, burstiness=burstiness, seed=seed)
        for item, delay in zip(workload, delays, strict=True):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(item)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's aggregate figures (latencies in ms) over the successful requests."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.e2el for r in ok) / duration,
        "mean_tokens_per_chunk": total_out / max(1, sum(r.num_chunks for r in ok)),
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2el - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"std_{name}_ms"] = float(ms.std())
        for p in PERCENTILES:
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def format_summary(s: dict[str, Any], *, title: str) -> str:
    width = max(52, len(title) + 4)
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>{width - 40}}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    row("Concurrency (sum e2e / duration):", s["concurrency"])
    row("Tokens per streamed chunk:", s["mean_tokens_per_chunk"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency (per token)"), ("e2el", "End-to-end Latency")):
        lines.append(f"{label:-^{width}}")
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", s[f"median_{name}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {name.upper()} (ms):", s[f"p{p}_{name}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)


def model_card(base_url: str, api_key: str | None) -> dict[str, Any]:
    """The server's first ``/v1/models`` entry (fd-serve adds ``max_model_len`` and ``vocab_size``)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fd-bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by +/- this fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: inf)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the server's model card")
    parser.add_argument("--json-out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 <= args.range_ratio < 1:
        print("fd-bench serve: error: --range-ratio must be in [0, 1)", file=sys.stderr)
        return 2
    import httpx

    try:
        card = model_card(args.url, args.api_key)
    except httpx.HTTPError as exc:  # connection refused, timeout, HTTP error status
        print(f"fd-bench serve: error: cannot read {args.url.rstrip('/')}/v1/models: {exc or type(exc).__name__}; "
              "is fd-serve running there? (start it, or pass --url)", file=sys.stderr)
        return 2
    model = args.model or card["id"]
    vocab_size = args.vocab_size or card.get("vocab_size")
    if vocab_size is None:
        print("fd-bench serve: error: the server does not report vocab_size; pass --vocab-size", file=sys.stderr)
        return 2
    workload = make_workload(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                             range_ratio=args.range_ratio, vocab_size=vocab_size, seed=args.seed)
    results, duration = asyncio.run(run_benchmark(
        base_url=args.url, model=model, workload=workload, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, api_key=args.api_key))
    summary = summarize(results, duration)
    limit = args.max_concurrency or "unbounded"
    print(format_summary(summary, title=f"fd-bench serve: {model}, max concurrency {limit}"))
    errors = sorted({r.error for r in results if not r.success})
    for error in errors[:5]:
        print(f"failed: {error}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) or (isinstance(v, float) and math.isinf(v)) else v)
                     for k, v in vars(args).items()},
            "model": model, **summary,
            "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
            "ttfts": [r.ttft for r in results], "e2els": [r.e2el for r in results],
            "errors": [r.error for r in results]}, indent=2))
    return 0 if summary["completed"] else 1
