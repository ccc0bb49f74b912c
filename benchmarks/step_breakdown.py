"""Where a decode (or prefill) step's time goes: ms per component, for each kernel choice, in one run.

Fills the engine with ``--rows`` requests of ``--prompt-len`` tokens, runs their prefills, then
times ``--steps`` decode steps; with ``--phase prefill`` it times those prefills instead (steps of
up to 2,048 tokens, after an untimed prefill of a few requests). Each swappable kernel
(``fd_core.model.kernels``; the linear layers by weight name) and the embedding are wrapped in a
timer; "engine + other" is the rest of ``EngineCore.step`` (scheduling, metadata, sampling, outputs).
Paddle's CPU ops run synchronously, so wall time around a call is that op's time.

    python benchmarks/step_breakdown.py --kernels portable,auto --json-out /tmp/breakdown.json

Each ``--kernels`` value is the cpu platform's ``kernels`` option and runs in its own process
(``portable``: the Paddle reference kernels; ``auto``: what this CPU's capabilities select);
each ``--variant LABEL=JSON`` runs ``auto`` with more config sections, e.g. weights kept in their
GGUF blocks:

    python benchmarks/step_breakdown.py --rows 1 --kernels auto \
        --variant 'keep={"model": {"quantized_weights": "keep"}}'

``--threads 1,2`` runs ``auto`` once per math-thread count (the cpu platform's ``num_threads``)
and adds each component's speed-up and its parallel share by Amdahl's law: the thread-scaling
model of each kernel (docs/platforms.md, "Many cores").

A mixture-of-experts model's rows name the whole MoE block (routing, experts, gathers and
scatters; its parts are rows too) and the ``moe_experts`` kernel; where that runs the portable
path, its parts: the routing and its experts' products (``linear expert gate_up``...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Timers:
    """Seconds and calls per component name; ``holders``: the names whose calls held timed calls
    (the model's forward, the MoE block...), whose time their parts' rows already count."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.holders: set[str] = set()
        self.on = False
        self._open: list[str] = []   # the timed calls in progress, outermost first

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            key = name(*args) if callable(name) else name
            if self._open:
                self.holders.add(self._open[-1])
            self._open.append(key)
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._open.pop()
                self.seconds[key] += time.perf_counter() - begin
                self.calls[key] += 1

        return timed


def instrument(llm: Any, timers: Timers) -> None:
    """Put timers around the model's kernels and direct Paddle ops (this process only)."""
    import dataclasses

    import paddle.nn.functional as F

    from fd_core.model import llama
    from fd_kernels import moe

    model = llm.engine.runner.model
    chosen = model.kernels.chosen
    names = {id(model.lm_head): "lm_head"}
    for layer in model.layers:
        names |= {id(getattr(layer, field)): field for field in ("qkv", "o", "gate_up", "down")}
        if layer.moe is not None:   # a mixture-of-experts layer: its experts' products by kind
            shared = [layer.moe.shared] if layer.moe.shared else []
            for kind, pairs in (("expert", layer.moe.experts), ("shared expert", shared)):
                for gate_up, down in pairs:
                    names |= {id(gate_up): f"{kind} gate_up", id(down): f"{kind} down"}
    moe.route = timers.wrap("moe routing", moe.route)
    llama.moe_forward = timers.wrap("moe block (routing, experts, gather/scatter)", llama.moe_forward)
    linear = chosen["linear"].fn

    class TimedLinear:   # the linear kernel, timed per weight name
        prepare = staticmethod(linear.prepare)
        __call__ = staticmethod(timers.wrap(lambda x, prepared, *rest: f"linear {names.get(id(prepared), '?')}",
                                            linear.__call__))

    layer_op = chosen["decoder_layer"]

    class TimedDecoderLayer:   # the fused layer keeps its bindings, its calls timed
        bind = staticmethod(layer_op.fn.bind)
        if callable(layer_op.fn):   # "composed" is never called, nor joins
            join = staticmethod(layer_op.fn.join)
            __call__ = staticmethod(timers.wrap(f"decoder_layer ({layer_op.name})", layer_op.fn.__call__))

    class TimedFunctional:
        embedding = staticmethod(timers.wrap("embedding", F.embedding))

    llama.F = TimedFunctional
    timed = {op: dataclasses.replace(v, fn=timers.wrap(f"{op} ({v.name})", v.fn))
             for op, v in chosen.items() if op not in ("rope_write_kv", "linear", "decoder_layer")}
    timed["linear"] = dataclasses.replace(chosen["linear"], fn=TimedLinear())
    timed["decoder_layer"] = dataclasses.replace(layer_op, fn=TimedDecoderLayer())
    # rope_write_kv is a per-step factory: time the per-layer function it returns
    factory = chosen["rope_write_kv"].fn
    timed["rope_write_kv"] = dataclasses.replace(
        chosen["rope_write_kv"],
        fn=lambda *a: timers.wrap(f"rope_write_kv ({chosen['rope_write_kv'].name})", factory(*a)))
    model.kernels = dataclasses.replace(model.kernels, chosen=timed)
    model.forward = timers.wrap("model forward", model.forward)


def measure(kernels: str, rows: int, prompt_len: int, steps: int, sections: dict[str, Any],
            phase: str = "decode") -> dict:
    from fd_core import LLM
    from fd_core.config import CacheSection
    from fd_core.request import Request, SamplingParams

    requested, sections = sections, dict(sections)
    block_size = sections.get("cache", {}).get("block_size", CacheSection.model_fields["block_size"].default)
    options = {"kernels": kernels, **sections.pop("platform", {}).get("options", {})}
    llm = LLM(sections.pop("model", None), platform={"name": "cpu", "options": options},
              engine={"max_num_seqs": rows, "max_num_batched_tokens": 2048, **sections.pop("engine", {})},
              cache={"num_blocks": rows * -(-(prompt_len + steps + 64) // block_size) + 64,
                     "enable_prefix_caching": False, **sections.pop("cache", {})},
              **sections)
    timers = Timers()
    instrument(llm, timers)
    core = llm.engine
    vocab = core.runner.arch.vocab_size

    def add(count: int, max_tokens: int, tag: str) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(count):
            core.add_request(Request(f"{tag}{i}", [(7 * i + 13 * t) % (vocab - 3) + 3 for t in range(prompt_len)],
                                     sampling_params=params))

    def step() -> None:
        timers.seconds["engine step"] -= time.perf_counter()
        failed = [o.error for o in core.step() if o.error]
        timers.seconds["engine step"] += time.perf_counter()
        if failed:
            raise RuntimeError(f"a request failed: {failed[0]}")

    def prefill_all(expected_tokens: int) -> int:   # engine steps until every prompt is computed
        taken = 0
        while core.stats().num_prompt_tokens < expected_tokens:
            step()
            taken += 1
        return taken

    if phase == "prefill":
        add(min(rows, 4), 1, "warm")
        prefill_all(min(rows, 4) * prompt_len)
        done = core.stats().num_prompt_tokens
        add(rows, 1, "r")
        timers.seconds.clear()
        timers.on = True
        begin = time.perf_counter()
        steps = prefill_all(done + rows * prompt_len)
        rate = {"prefill_tok_s": round(rows * prompt_len / (time.perf_counter() - begin), 1)}
    else:
        # the prompts' prefill takes several steps, and the first rows decode during them (each
        # taking a token of a step's budget): room for those tokens too, so that no row finishes
        # before the timed steps are over
        budget = core.config.engine.max_num_batched_tokens
        prefill_steps = -(-rows * prompt_len // max(1, budget - rows)) + 1
        add(rows, prefill_steps + steps + 4, "r")
        prefill_all(rows * prompt_len)
        step()                           # one untimed decode step
        timers.seconds.clear()
        timers.on = True
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        running = core.stats().kv.num_running
        if running != rows:
            raise RuntimeError(f"{running} rows ran the timed decode steps, not {rows}")
        rate = {"decode_tok_s": round(rows * steps / (time.perf_counter() - begin), 1)}
    per_step = {name: round(1000 * s / steps, 3) for name, s in timers.seconds.items()}
    inner = sum(v for k, v in per_step.items() if k != "engine step" and k not in timers.holders)
    per_step["model: other ops"] = round(per_step["model forward"] - inner, 3)
    per_step["engine + other"] = round(per_step["engine step"] - per_step["model forward"], 3)
    return {"kernels": kernels, "sections": requested, "chosen": core.runner.kernels.describe(), "rows": rows,
            "prompt_len": prompt_len, "phase": phase, "steps": steps, "ms_per_step": per_step, **rate}


def print_scaling(reports: list[dict], components: list[str]) -> None:
    """Each component's speed-up from the fewest threads to the most, and the parallel share that
    Amdahl's law gives it (1: all of it scaled; 0: none did)."""
    first, last = reports[0], reports[-1]
    ratio = int(last["label"].split()[0]) / int(first["label"].split()[0])
    print(f"\n| component | speed-up {first['label']} -> {last['label']} | parallel share (Amdahl) |")
    print("|---|---|---|")
    for name in components:
        before, after = first["ms_per_step"].get(name, 0), last["ms_per_step"].get(name, 0)
        if name == "steps" or before <= 0 or after <= 0:
            continue
        speed_up = before / after
        share = (1 - 1 / speed_up) / (1 - 1 / ratio)
        print(f"| {name} | {speed_up:.2f}x | {share:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="portable,auto")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="decode steps to time")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                        help="also run the auto kernels with these config sections, shown as LABEL")
    parser.add_argument("--threads", default="", metavar="N,M,...",
                        help="also run the auto kernels with each math-thread count (platform num_threads), "
                             "and print each component's speed-up from the first count to the last")
    parser.add_argument("--json-out")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # internal: measure one choice in this process
    parser.add_argument("--one-sections", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rows, args.prompt_len, args.steps, json.loads(args.one_sections),
                                 args.phase)))
        return 0
    runs = [(kernels, kernels, "{}") for kernels in args.kernels.split(",") if kernels]
    runs += [(label, "auto", sections) for label, _, sections in (v.partition("=") for v in args.variant)]
    threads = [int(t) for t in args.threads.split(",") if t]
    runs += [(f"{t} threads", "auto", json.dumps({"platform": {"options": {"num_threads": t}}})) for t in threads]
    reports = []
    for label, kernels, sections in runs:
        proc = subprocess.run([sys.executable, __file__, "--one", kernels, "--one-sections", sections,
                               "--rows", str(args.rows), "--prompt-len", str(args.prompt_len),
                               "--steps", str(args.steps), "--phase", args.phase], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        reports.append({"label": label, **json.loads(proc.stdout.strip().splitlines()[-1])})
    from fd_plugins.platforms.cpu_features import probe_cpu_features

    cpu = probe_cpu_features().describe()
    components = sorted({k for r in reports for k in r["ms_per_step"]})
    if args.phase == "prefill":
        print(f"CPU: {cpu}; prefill of {args.rows} prompts of {args.prompt_len} tokens, ms per step")
    else:
        print(f"CPU: {cpu}; decode step of {args.rows} rows at context ~{args.prompt_len}, ms per step")
    print("| component | " + " | ".join(r["label"] for r in reports) + " |")
    print("|---|" + "---|" * len(reports))
    for name in components:
        print(f"| {name} | " + " | ".join(f"{r['ms_per_step'].get(name, 0):.2f}" for r in reports) + " |")
    rate = f"{args.phase}_tok_s"
    print("| steps | " + " | ".join(str(r["steps"]) for r in reports) + " |")
    print(f"| {args.phase} tok/s | " + " | ".join(str(r[rate]) for r in reports) + " |")
    for r in reports:
        print(f"{r['label']}: {r['chosen']}")
    if len(threads) > 1:
        print_scaling([r for r in reports if r["label"].endswith(" threads")], components)
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"cpu": cpu, "reports": reports}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
