"""Decode and prefill speed of the default model: fd-engine beside Hugging Face transformers.

Decode tokens/s at batch B = B * (N - 1) / (t(N new tokens) - t(1 new token)), with B prompts
of the same length, greedy, ignore_eos; both engines get the same token ids. Prefill tokens/s
= prompt length / t(1 new token) for one 512-token prompt. Each figure is the median of
``--repeats`` runs after a warm-up. Both run float32 on the CPU in the same process, one after
the other (torch and paddle each use all cores).

    python benchmarks/model_speed.py --json-out /tmp/model_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fd_engine_runner(model: str, max_num_seqs: int):
    from fd_core.engine.llm import LLM
    from fd_core.request import SamplingParams

    llm = LLM(model, engine={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 1024},
              cache={"enable_prefix_caching": False, "num_blocks": 2048})

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)

    return generate


def hf_runner(gguf_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 torch_dtype=torch.float32)
    model.eval()

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    return generate


def measure(generate, *, batches: list[int], decode_tokens: int, prompt_len: int, prefill_len: int,
            repeats: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    figures: dict = {"decode_tokens_per_s": {}, "prefill_tokens_per_s": None}
    for batch in batches:
        prompts = rng.integers(3, vocab, (batch, prompt_len)).tolist()
        t1 = _median_time(partial(generate, prompts, 1), repeats)
        tn = _median_time(partial(generate, prompts, decode_tokens), repeats)
        figures["decode_tokens_per_s"][batch] = batch * (decode_tokens - 1) / (tn - t1)
    long_prompt = rng.integers(3, vocab, (1, prefill_len)).tolist()
    figures["prefill_tokens_per_s"] = prefill_len / _median_time(lambda: generate(long_prompt, 1), repeats)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    from fd_core.model.default_model import DEFAULT_MODEL_ALIAS, resolve_alias

    gguf_path = resolve_alias(DEFAULT_MODEL_ALIAS)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(batches=batches, decode_tokens=args.decode_tokens, prompt_len=args.prompt_len,
                  prefill_len=args.prefill_len, repeats=args.repeats, vocab=49152, seed=args.seed)
    results = {"fd-engine": measure(fd_engine_runner(DEFAULT_MODEL_ALIAS, max(batches)), **common)}
    if not args.skip_hf:
        results["hf-transformers"] = measure(hf_runner(gguf_path), **common)

    print(f"{'engine':<18}" + "".join(f"{'decode b=' + str(b):>14}" for b in batches)
          + f"{'prefill ' + str(args.prefill_len):>14}")
    for engine, figures in results.items():
        print(f"{engine:<18}" + "".join(f"{figures['decode_tokens_per_s'][b]:>14.1f}" for b in batches)
              + f"{figures['prefill_tokens_per_s']:>14.1f}")
    print("(tokens/s, float32, median of", args.repeats, "runs)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": vars(args) | {"json_out": str(args.json_out)},
                                             "results": results}, indent=2))


if __name__ == "__main__":
    main()
