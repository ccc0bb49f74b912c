"""One sequence alone: fd-engine beside llama.cpp on the same GGUF, in one run.

A prompt of ``--prompt-len`` seeded token ids, then ``--new-tokens`` greedy tokens (no stop). For
each engine: prefill tok/s = prompt length / t(1 new token), decode tok/s = (N - 1) / (t(N) - t(1)),
end to end = N / t(N), wall clock through each one's Python API after a warm-up (t(1) the best of
two). fd-engine runs once per ``--fd LABEL=JSON`` (config sections; default: float32 weights and
weights kept in their GGUF blocks), each in its own process; ``--fd-tree LABEL=PATH`` runs that
label from another source tree (e.g. a ``git worktree`` of the commit before a change, for
before/after in one run). llama.cpp runs when ``--llamacpp-venv`` names a venv with
``llama-cpp-python`` (``n_threads`` = the CPUs here).

    python benchmarks/single_sequence.py --llamacpp-venv /tmp/venv-llama --json-out /tmp/single.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from side_by_side import import_root

# Runs inside the engine's process (fd-engine) or the llama.cpp venv; prints one JSON line.
_TIMING = """
import json, sys, time
import numpy as np
prompt_len, new_tokens = {prompt_len}, {new_tokens}
prompt = np.random.default_rng({seed}).integers(100, {max_token_id}, prompt_len).tolist()
{setup}
def timed(n):
    start = time.perf_counter()
    generate(n)
    return time.perf_counter() - start
timed(4)
first = min(timed(1) for _ in range(2))
whole = timed(new_tokens)
print(json.dumps({{"prefill_tok_s": prompt_len / first, "decode_tok_s": (new_tokens - 1) / (whole - first),
                  "end_to_end_tok_s": new_tokens / whole, "seconds": whole}}))
"""

_FD_SETUP = """
from fd_core.engine.llm import LLM
from fd_core.request import SamplingParams
sections = json.loads({sections!r})
model = {{"source": {model!r}, **sections.pop("model", {{}})}}
engine = {{"max_num_seqs": 8, **sections.pop("engine", {{}})}}
cache = {{"enable_prefix_caching": False, "num_blocks": 512, **sections.pop("cache", {{}})}}
llm = LLM(model, engine=engine, cache=cache, **sections)
def generate(n):
    llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
"""

_LLAMACPP_SETUP = """
import llama_cpp
if {plain_buffers}:   # no AMX / repacked weight buffers: llama.cpp's plain CPU kernels
    _defaults = llama_cpp.llama_model_default_params
    def _plain():
        params = _defaults()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama_model_default_params = llama_cpp.llama.llama_cpp.llama_model_default_params = _plain
from llama_cpp import Llama
llm = Llama(model_path={model!r}, n_threads={threads}, n_threads_batch={threads}, n_ctx=2048, n_batch=512,
            verbose=False, seed=0)
def generate(n):
    llm.reset()
    for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
        if count == n:
            break
"""


def _run(python: str, setup: str, args: argparse.Namespace, tree: Path | None = None) -> dict:
    """One engine's timings, in a process of its own (imports from ``tree`` when given)."""
    script = textwrap.dedent(_TIMING).format(prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                             seed=args.seed, max_token_id=args.max_token_id,
                                             setup=textwrap.dedent(setup))
    with tempfile.TemporaryDirectory(prefix="fd-single-") as scratch:
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = str(import_root(tree, Path(scratch)))
        # cwd: not this checkout, whose packages `python -c` would import first
        proc = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env, cwd=scratch)
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    parser.add_argument("--fd", action="append", metavar="LABEL=JSON",
                        help='fd-engine with these config sections (default: fp32={} and '
                             'keep={"model": {"quantized_weights": "keep"}})')
    parser.add_argument("--fd-tree", action="append", default=[], metavar="LABEL=PATH",
                        help="run --fd LABEL from the source tree at PATH (default: the installed one)")
    parser.add_argument("--llamacpp-venv", type=Path)
    parser.add_argument("--llamacpp-plain-buffers", action="store_true",
                        help="load llama.cpp's weights without its extra buffer types (AMX, repacked): "
                             "llama-cpp-python 0.3.36's AMX path crashed in generation on an AMX Xeon")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-token-id", type=int, default=40000,
                        help="prompt ids are drawn from [100, this): at most the model's vocabulary")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if args.model is None:
        from fd_core.model.default_model import DEFAULT_MODEL_ALIAS, resolve_alias

        args.model = str(resolve_alias(DEFAULT_MODEL_ALIAS))
    variants = args.fd or ["fp32={}", 'keep={"model": {"quantized_weights": "keep"}}']
    trees = {label: Path(path) for label, _, path in (t.partition("=") for t in args.fd_tree)}
    results = {}
    for label, _, sections in (v.partition("=") for v in variants):
        results[f"fd-engine {label}"] = _run(sys.executable, _FD_SETUP.format(sections=sections, model=args.model),
                                             args, trees.get(label))
    if args.llamacpp_venv:
        setup = _LLAMACPP_SETUP.format(model=args.model, threads=len(os.sched_getaffinity(0)),
                                       plain_buffers=args.llamacpp_plain_buffers)
        results["llama.cpp"] = _run(str(args.llamacpp_venv / "bin" / "python"), setup, args)
    from fd_plugins.platforms.cpu_features import probe_cpu_features

    cpu = probe_cpu_features().describe()
    print(f"CPU: {cpu}; {Path(args.model).name}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens")
    print("| engine | prefill tok/s | decode tok/s | end to end tok/s |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | {r['end_to_end_tok_s']:.1f} |")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"cpu": cpu, "args": vars(args) | {"llamacpp_venv": str(args.llamacpp_venv)},
                       "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
