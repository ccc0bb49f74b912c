"""Offline throughput: fd-engine (v0 and v1) beside Hugging Face transformers on one workload.

The same seeded token-id requests go to each engine, one after the other in this process.
HF runs static batches of ``--hf-batch-size`` with left padding and ``generate`` (greedy,
exactly ``--output-len`` new tokens), as the shared bench harness's HF baseline does.

    python benchmarks/offline_throughput.py --resource-managers v0,v1 --json-out /tmp/offline.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from fd_core.bench.throughput import (
    add_engine_arguments,
    add_workload_arguments,
    format_results,
    measure,
    run_resource_managers,
    workload_from,
)
from fd_core.bench.workload import WorkItem


def hf_run(model, batch_size: int, workload: list[WorkItem]) -> int:
    import torch

    produced = 0
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(item.prompt) for item in batch)
        ids = torch.tensor([[0] * (width - len(i.prompt)) + i.prompt for i in batch])
        mask = torch.tensor([[0] * (width - len(i.prompt)) + [1] * len(i.prompt) for i in batch])
        new = batch[0].output_len
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        produced += (out.shape[1] - width) * len(batch)
    return produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    results = run_resource_managers(args)
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        from fd_core.model.default_model import resolve_alias

        path = resolve_alias(args.model)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        workload = workload_from(args, model.config.vocab_size)
        hf_run(model, args.hf_batch_size, workload[:2])  # warm-up
        results.append(measure(f"hf static batch {args.hf_batch_size}", workload,
                               lambda w: hf_run(model, args.hf_batch_size, w)))
    print(format_results(results))
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
