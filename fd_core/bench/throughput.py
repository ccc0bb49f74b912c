"""``fd-bench throughput``: offline throughput of the engine on a seeded synthetic workload.

Requests are random token ids (seeded) with input lengths drawn uniformly from
``[input_min, input_max]``, a fixed output length and ignore_eos, like ``vllm bench throughput``
with the random dataset. Prints requests/s, output tok/s and total tok/s and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts and their output lengths."""

    prompts: list[list[int]]
    output_len: int
    seed: int

    @classmethod
    def synthetic(cls, *, num_requests: int, input_min: int, input_max: int, output_len: int,
                  vocab_size: int, seed: int = 0) -> Workload:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(input_min, input_max + 1, num_requests)
        prompts = [rng.integers(3, vocab_size, int(n)).tolist() for n in lengths]
        return cls(prompts, output_len, seed)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    """Figures of one timed run."""

    label: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def measure(label: str, workload: Workload, run) -> ThroughputResult:
    """Time ``run(workload) -> output token count`` and derive the rates."""
    start = time.perf_counter()
    output_tokens = run(workload)
    elapsed = time.perf_counter() - start
    n = len(workload.prompts)
    return ThroughputResult(label, n, workload.num_prompt_tokens, output_tokens, elapsed, n / elapsed,
                            output_tokens / elapsed, (workload.num_prompt_tokens + output_tokens) / elapsed)


def run_engine(llm, workload: Workload) -> int:
    """Generate the workload with an fd-engine ``LLM``; returns the output token count."""
    from fd_core.request import SamplingParams

    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    results = llm.generate(workload.prompts, params, use_tqdm=False)
    assert all(len(r.token_ids) == workload.output_len for r in results)
    return sum(len(r.token_ids) for r in results)


def format_results(results: list[ThroughputResult]) -> str:
    header = f"{'run':<28} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'wall s':>8}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r.label:<28} {r.requests_per_s:>8.2f} {r.output_tokens_per_s:>10.1f} "
                     f"{r.total_tokens_per_s:>12.1f} {r.elapsed_s:>8.1f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-min", type=int, default=128)
    parser.add_argument("--input-max", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resource-managers", default="v1", help="comma-separated, e.g. v0,v1")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--json-out", type=Path, default=None)


def main(argv: list[str] | None = None) -> int:
    """Run the workload once per resource manager (after a short warm-up) and print the table."""
    from fd_core.engine.llm import LLM

    parser = argparse.ArgumentParser(prog="fd-bench throughput", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    results = []
    for name in args.resource_managers.split(","):
        llm = LLM(args.model, resource_manager={"name": name},
                  engine={"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
                  cache={"num_blocks": args.num_blocks, "enable_prefix_caching": False})
        workload = Workload.synthetic(num_requests=args.num_requests, input_min=args.input_min,
                                      input_max=args.input_max, output_len=args.output_len,
                                      vocab_size=llm.engine.runner.arch.vocab_size, seed=args.seed)
        warm = Workload(workload.prompts[:2], 4, args.seed)
        run_engine(llm, warm)
        results.append(measure(f"fd-engine {name}", workload, partial(run_engine, llm)))
    print(format_results(results))
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": [asdict(r) for r in results]}, indent=2))
    return 0
