"""``fd-bench throughput``: offline throughput of the engine on a seeded synthetic workload.

Like ``vllm bench throughput`` with the random dataset: prompts are random token ids with
lengths drawn from ``[input_len * (1 - r), input_len * (1 + r)]``, every request generates
its output length with ignore_eos (greedy). Prints requests/s, output tok/s and total tok/s
per resource manager, after an untimed warm-up, and saves JSON.

    fd-bench throughput --num-prompts 128 --input-len 320 --range-ratio 0.6 --output-len 128 \\
        --resource-managers v0,v1 --json-out /tmp/throughput.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from fd_core.bench.workload import WorkItem, make_workload


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    """Figures of one timed run of a whole workload."""

    label: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def measure(label: str, workload: list[WorkItem], run: Callable[[list[WorkItem]], int]) -> ThroughputResult:
    """Time ``run(workload) -> output token count`` once and derive the rates."""
    prompt_tokens = sum(len(item.prompt) for item in workload)
    start = time.perf_counter()
    output_tokens = run(workload)
    elapsed = time.perf_counter() - start
    n = len(workload)
    return ThroughputResult(label, n, prompt_tokens, output_tokens, elapsed, n / elapsed,
                            output_tokens / elapsed, (prompt_tokens + output_tokens) / elapsed)


def run_engine(llm, workload: list[WorkItem]) -> int:
    """Generate the workload with an fd-engine ``LLM``; returns the output token count."""
    from fd_core.request import SamplingParams

    params = [SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True) for item in workload]
    results = llm.generate([item.prompt for item in workload], params, use_tqdm=False)
    produced = [len(r.token_ids) for r in results]
    assert produced == [item.output_len for item in workload], "a request stopped early"
    return sum(produced)


def format_results(results: list[ThroughputResult]) -> str:
    """A fixed-width table of the runs."""
    header = f"{'run':<30} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'wall s':>8}"
    lines = [header, "-" * len(header)]
    lines += [f"{r.label:<30} {r.requests_per_s:>8.2f} {r.output_tokens_per_s:>10.1f} "
              f"{r.total_tokens_per_s:>12.1f} {r.elapsed_s:>8.1f}" for r in results]
    return "\n".join(lines)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that define the workload (shared with benchmarks/offline_throughput.py)."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=320)
    parser.add_argument("--range-ratio", type=float, default=0.6, help="input lengths: input-len * (1 +- r)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)


def workload_from(args: argparse.Namespace, vocab_size: int) -> list[WorkItem]:
    return make_workload(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                         range_ratio=args.range_ratio, output_range_ratio=0.0, vocab_size=vocab_size,
                         seed=args.seed)


def run_resource_managers(args: argparse.Namespace) -> list[ThroughputResult]:
    """One timed run per resource manager named in ``args.resource_managers``."""
    from fd_core.engine.llm import LLM

    results = []
    for name in args.resource_managers.split(","):
        llm = LLM(args.model, resource_manager={"name": name},
                  engine={"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
                  cache={"num_blocks": args.num_blocks, "enable_prefix_caching": False})
        workload = workload_from(args, llm.engine.runner.arch.vocab_size)
        run_engine(llm, [WorkItem(item.prompt, 4) for item in workload[:2]])  # warm-up
        results.append(measure(f"fd-engine {name}", workload, partial(run_engine, llm)))
    return results


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resource-managers", default="v1", help="comma-separated, e.g. v0,v1")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fd-bench throughput", description=__doc__.split("\n")[0])
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    results = run_resource_managers(args)
    print(format_results(results))
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": [asdict(r) for r in results]}, indent=2))
    return 0
