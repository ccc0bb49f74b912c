"""Speculative decoding's speed-up: each proposer beside none, on input-grounded and open-ended prompts.

Input-grounded prompts ask the default model to repeat or lightly edit a given text (prompt lookup
finds what follows); open-ended ones ask for new text (it mostly does not). For one sequence (each
prompt alone, in turn) and for a batch of ``--batch`` requests (the prompts cycled), greedy with
``--new-tokens`` tokens (no stop), each proposer in an engine of its own after a warm-up: end-to-end
output tok/s, seconds, and the acceptance rate (accepted / proposed tokens, from the engine's
counters). Outputs with a proposer are checked equal to those without (greedy is exact).

With ``--llamacpp-venv`` (a venv with ``llama-cpp-python``, see single_sequence.py), llama.cpp runs
the one-sequence prompts on the same GGUF with and without its prompt-lookup draft
(``LlamaPromptLookupDecoding``), from the same token ids.

    python benchmarks/speculative_decoding.py --json-out benchmarks/results/speculative_decoding.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = ("The river town woke slowly. Fishermen carried their nets down the stone steps, the baker "
        "opened the shutters of the corner shop, and a thin smoke rose from the chimneys along the "
        "quay. By eight o'clock the market square was full: farmers sold apples, cheese and honey, "
        "children chased pigeons between the stalls, and the old clock on the town hall struck the "
        "hour a little late, as it had done for forty years. Nobody minded. In this town, people said, "
        "time was something you shared, not something you kept.")
PROMPTS = {
    "input_grounded": [
        f"Repeat the following text exactly, word for word:\n\n{TEXT}",
        f"Rewrite the following text in the present tense and change nothing else:\n\n{TEXT}",
        f"Copy this paragraph and put each sentence on its own line:\n\n{TEXT}",
        f"Fix any mistakes in this text and return the whole text:\n\n{TEXT}",
    ],
    "open_ended": [
        "Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "List ten ideas for a weekend trip and say why each is fun.",
        "Write a letter to a friend about your favourite book.",
    ],
}


def _prompt_ids(tokenizer) -> dict[str, list[list[int]]]:
    return {kind: [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
                   for text in texts] for kind, texts in PROMPTS.items()}


def _fd_runs(args: argparse.Namespace, proposer: str, prompts: dict[str, list[list[int]]]) -> dict:
    """Every workload through one engine with ``proposer``: seconds, tokens, acceptance, outputs."""
    from fd_core.engine.llm import LLM
    from fd_core.request import SamplingParams

    section = {"name": proposer, "num_speculative_tokens": args.k} if proposer != "none" else {"name": "none"}
    llm = LLM(cache={"enable_prefix_caching": False, "num_blocks": 1200}, engine={"max_num_seqs": args.batch},
              proposer=section)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts["open_ended"][:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    rows = {}
    for kind, ids in prompts.items():
        # w1: each prompt alone, one after the other; wN: N requests at once, the prompts cycled
        for label, batches in (("w1", [[p] for p in ids]),
                               (f"w{args.batch}", [[ids[i % len(ids)] for i in range(args.batch)]])):
            before = llm.engine.stats()
            begin = time.perf_counter()
            results = [r for batch in batches for r in llm.generate(batch, params, use_tqdm=False)]
            seconds = time.perf_counter() - begin
            after = llm.engine.stats()
            tokens = sum(len(r.token_ids) for r in results)
            proposed = after.num_proposed_tokens - before.num_proposed_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            rows[f"{kind} {label}"] = {
                "seconds": round(seconds, 3), "output_tokens": tokens, "output_tok_s": round(tokens / seconds, 1),
                "steps": after.num_steps - before.num_steps, "proposed": proposed, "accepted": accepted,
                "acceptance": round(accepted / proposed, 3) if proposed else None,
                "outputs": [r.token_ids for r in results]}
    llm.close()
    return rows


_LLAMACPP = """
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
job = json.load(open(sys.argv[1]))
out = {}
for draft in ("none", "prompt_lookup"):
    kwargs = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=job["k"])} if draft != "none" else {}
    llm = Llama(model_path=job["model"], n_threads=job["threads"], n_threads_batch=job["threads"], n_ctx=2048,
                n_batch=512, verbose=False, seed=0, **kwargs)
    for kind, prompts in job["prompts"].items():
        def run(ids, n):
            llm.reset()
            tokens = []
            for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == n:
                    return tokens
        run(prompts[0], 4)
        begin = time.perf_counter()
        tokens = sum(len(run(ids, job["new_tokens"])) for ids in prompts)
        seconds = time.perf_counter() - begin
        out[f"{draft} {kind} w1"] = {"seconds": round(seconds, 3), "output_tok_s": round(tokens / seconds, 1)}
    del llm
print(json.dumps(out))
"""


def _llamacpp(args: argparse.Namespace, prompts: dict[str, list[list[int]]]) -> dict:
    from fd_core.model.default_model import DEFAULT_MODEL_ALIAS, resolve_alias

    with tempfile.TemporaryDirectory() as scratch:
        job = Path(scratch) / "job.json"
        job.write_text(json.dumps({"model": str(resolve_alias(DEFAULT_MODEL_ALIAS)), "k": args.k,
                                   "threads": len(os.sched_getaffinity(0)), "new_tokens": args.new_tokens,
                                   "prompts": prompts}))
        proc = subprocess.run([str(args.llamacpp_venv / "bin" / "python"), "-c", _LLAMACPP, str(job)],
                              capture_output=True, text=True, cwd=scratch)
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proposers", default="none,ngram", help="comma-separated; 'none' is the baseline")
    parser.add_argument("--k", type=int, default=4, help="proposer.num_speculative_tokens")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--llamacpp-venv", type=Path)
    parser.add_argument("--json-out")
    args = parser.parse_args()

    from fd_core.model.loader import load_tokenizer
    from fd_plugins.platforms.cpu_features import probe_cpu_features

    prompts = _prompt_ids(load_tokenizer())
    results = {proposer: _fd_runs(args, proposer, prompts) for proposer in args.proposers.split(",")}
    baseline = results.get("none")
    cpu = probe_cpu_features().describe()
    print(f"CPU: {cpu}; default model, greedy, {args.new_tokens} new tokens, k = {args.k}")
    print("| workload | proposer | output tok/s | seconds | speed-up | acceptance | same output |")
    print("|---|---|---|---|---|---|---|")
    for workload in next(iter(results.values())):
        for proposer, rows in results.items():
            row = rows[workload]
            base = baseline[workload] if baseline else row
            row["speed_up"] = round(row["output_tok_s"] / base["output_tok_s"], 3)
            row["same_output"] = row["outputs"] == base["outputs"]
            print(f"| {workload} | {proposer} | {row['output_tok_s']} | {row['seconds']} | {row['speed_up']}x | "
                  f"{row['acceptance']} | {row['same_output']} |")
    llamacpp = _llamacpp(args, prompts) if args.llamacpp_venv else None
    if llamacpp:
        for name, row in llamacpp.items():
            print(f"| llama.cpp {name} | | {row['output_tok_s']} | {row['seconds']} | | | |")
    for rows in results.values():
        for row in rows.values():
            del row["outputs"]
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"cpu": cpu, "args": vars(args) | {"llamacpp_venv": str(args.llamacpp_venv)},
                       "fd_engine": results, "llama_cpp": llamacpp}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
