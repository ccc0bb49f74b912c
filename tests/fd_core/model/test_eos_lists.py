"""Every EOS a model names stops generation: ``generation_config.json``'s list (Llama 3 names three,
Gemma its ``<end_of_turn>``) beside the tokenizer's own."""

from __future__ import annotations

import json
from pathlib import Path

from fd_core.engine.llm import LLM
from fd_core.model.loader import load_model
from fd_core.request import FinishReason, SamplingParams
from fd_core.testing.tiny_model import make_tiny_llama

PROMPT = [11, 12, 13, 14, 15]


def test_each_eos_of_generation_config_ends_a_request(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "model")
    with LLM(model=str(folder), cache={"num_blocks": 32}) as llm:
        free_run = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    tokenizer_eos = load_model(str(folder)).tokenizer.eos_token_ids
    second, fifth = free_run.token_ids[1], free_run.token_ids[4]
    assert second not in tokenizer_eos and fifth not in tokenizer_eos
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [fifth, second]}))
    loaded = load_model(str(folder))
    assert {second, fifth} | set(tokenizer_eos) <= set(loaded.arch.eos_token_ids)
    with LLM(model=str(folder), cache={"num_blocks": 32}) as llm:
        stopped = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert stopped.token_ids == free_run.token_ids[:2]
    assert stopped.finish_reason == FinishReason.STOP
