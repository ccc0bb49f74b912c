"""The default SmolLM2 GGUF through the whole engine gives Hugging Face's greedy tokens (float32).

Once with the cpu platform's portable kernels forced, once with what it picks on this host
(skipped where that is the same set: a CPU without AVX-512).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.hf, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 32


def _host_choice() -> str:
    from fd_core.model.kernels import select_kernels
    from fd_plugins.platforms.cpu import CpuPlatform

    return select_kernels(CpuPlatform().capabilities).describe()


def _host_selects_portable() -> bool:
    from fd_core.model.kernels import PORTABLE_KERNELS

    return _host_choice() == PORTABLE_KERNELS.describe()


@pytest.fixture(scope="module", params=["portable", "auto"])
def engine(request):
    from fd_core.engine.llm import LLM

    if request.param == "auto" and _host_selects_portable():
        pytest.skip("this host selects the portable kernels too")
    llm = LLM("smollm2-135m-instruct", cache={"num_blocks": 256, "block_size": 16},
              engine={"max_num_seqs": 8, "max_num_batched_tokens": 256},
              platform={"name": "cpu", "options": {"kernels": request.param}})
    from fd_core.model.kernels import PORTABLE_KERNELS

    expected = PORTABLE_KERNELS.describe() if request.param == "portable" else _host_choice()
    assert llm.engine.runner.kernels.describe() == expected
    return llm


@pytest.fixture(scope="module")
def hf_model():
    from fd_core.model.default_model import DEFAULT_MODEL_ALIAS, resolve_alias

    path = resolve_alias(DEFAULT_MODEL_ALIAS)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval()


def _hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    """Explicit greedy loop over HF's KV cache, EOS ignored."""
    ids = torch.tensor([prompt_ids])
    out, past = [], None
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def test_greedy_tokens_match_transformers_through_the_chat_template(engine, hf_model):
    from fd_core.request import SamplingParams

    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    matches = [r.token_ids == _hf_greedy(hf_model, p) for r, p in zip(ours, prompts, strict=True)]
    assert sum(matches) >= 4, f"only {sum(matches)}/{len(prompts)} prompts matched: {matches}"
    assert matches[0], "the France question must match exactly"
    assert "Paris" in ours[0].text
