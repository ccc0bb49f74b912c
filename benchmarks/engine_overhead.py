"""The engine's own cost per step (scheduling + token processing), without the model.

An EngineCore is wired with the real local scheduler, resource manager and default token
processor over the default model's tokenizer, but its runner only hands back a token per row
(ids cycling through ordinary vocabulary), so what is timed is everything except the forward
pass and sampling. Figures: median step time once ``--running`` requests are all decoding,
plus a cProfile breakdown by seam.

    python benchmarks/engine_overhead.py --running 64,256 --json-out /tmp/engine_overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

from fd_core.config import load_config
from fd_core.contracts.resource_manager import KVLimits
from fd_core.engine.core import EngineCore
from fd_core.outputs import SampledToken, StepResult
from fd_core.request import Request, SamplingParams
from fd_core.selection import resolve


class TokenOnlyRunner:
    """Stands in for the model runner: one plausible token per sampled row, no compute."""

    def __init__(self, arch) -> None:
        self.arch = arch
        self._next = 1000

    def execute(self, plan) -> StepResult:
        sampled = {}
        for row in plan.scheduled:
            if row.sample:
                self._next = 1000 + (self._next + 7) % 20000
                sampled[row.request.request_id] = SampledToken(self._next)
        return StepResult(sampled)

    def release(self, request_ids) -> None:
        pass


def build(running: int, resource_manager: str, block_size: int) -> EngineCore:
    from fd_core.model.default_model import DEFAULT_MODEL_ALIAS
    from fd_core.model.loader import load_tokenizer

    config = load_config(resource_manager={"name": resource_manager},
                         engine={"max_num_seqs": running, "max_num_batched_tokens": max(2048, running)})
    selection = resolve(config)
    tokenizer = load_tokenizer(DEFAULT_MODEL_ALIAS)
    limits = KVLimits(num_blocks=running * 64, block_size=block_size, max_num_seqs=running,
                      max_num_batched_tokens=config.engine.max_num_batched_tokens, max_model_len=2048,
                      enable_prefix_caching=True)
    hooks = selection.registry.hooks
    rm = selection["resource_manager"].create(limits=limits, hooks=hooks)
    scheduler = selection["scheduler"].create(hooks=hooks, max_queue_size=running * 2)
    tp = selection["token_processor"].create(tokenizer=tokenizer, resource_manager=rm, max_model_len=2048)

    class Arch:
        vocab_size = 49152

    return EngineCore(scheduler=scheduler, resource_manager=rm, token_processor=tp, runner=TokenOnlyRunner(Arch),
                      limits=limits, hooks=hooks, tokenizer=tokenizer, model_name="overhead")


def measure(running: int, resource_manager: str, steps: int) -> dict:
    engine = build(running, resource_manager, block_size=16)
    params = SamplingParams(max_tokens=2 * steps + 64, ignore_eos=True, stop=["\n\n###"])
    for i in range(running):
        engine.add_request(Request(f"r{i}", list(range(100, 228)), params, eos_token_ids=(2,)))
    while engine.resource_manager.stats().num_running < running or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine._in_engine.values()):
        engine.step()                                 # prefill everything first
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.get_results(timeout=0)
    profiler = cProfile.Profile()   # a second, profiled run: the profiler inflates times
    profiler.enable()
    for _ in range(steps):
        engine.step()
        engine.get_results(timeout=0)
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    per_seam = {name: stats.stats[key][3] / steps * 1e3 for key in stats.stats
                for name, (module, fn) in {"schedule": ("manager.py", "schedule"), "v0 schedule": ("v0.py", "schedule"),
                                           "token_processor.process": ("default.py", "process")}.items()
                if key[0].endswith(module) and key[2] == fn}
    return {"running": running, "resource_manager": resource_manager, "steps": steps,
            "median_step_ms": statistics.median(times) * 1e3, "p90_step_ms": sorted(times)[int(0.9 * steps)] * 1e3,
            "profile_ms_per_step": per_seam}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", default="64,256")
    parser.add_argument("--resource-managers", default="v1,v0")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    results = [measure(int(n), rm, args.steps) for rm in args.resource_managers.split(",")
               for n in args.running.split(",")]
    print(f"{'rm':<4} {'running':>8} {'median ms/step':>15} {'p90':>8}  profile (cumulative ms/step, profiled run)")
    for r in results:
        seams = ", ".join(f"{k} {v:.2f}" for k, v in r["profile_ms_per_step"].items())
        print(f"{r['resource_manager']:<4} {r['running']:>8} {r['median_step_ms']:>15.2f} {r['p90_step_ms']:>8.2f}"
              f"  {seams}")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
