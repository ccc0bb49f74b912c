"""The official ``openai`` client (sync and async, streaming and not) against fd-serve with the default model."""

from __future__ import annotations

import asyncio
import math
import mmap
import re

import httpx
import openai
import pytest

from fd_core.config import DEFAULT_MODEL, load_config
from fd_core.model.default_model import resolve_alias
from fd_core.model.gguf_file import read_gguf
from fd_core.model.loader import load_tokenizer
from fd_core.runner.kv_cache import kv_cache_bytes_per_block
from fd_core.server.metrics import MEMORY_PARTS
from fd_plugins.models.llama import LlamaFamily
from tests.fd_core.server.conftest import start_server

MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("default"), "--model.max_model_len", "1024",
                          "--cache.num_blocks", "256", name="default-model")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_tokens(tokenizer) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)))


def test_models(client):
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]


def test_completion_counts_tokens_and_stops_at_length(client, tokenizer):
    completion = client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.text.strip()
    assert completion.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    assert choice.text == tokenizer.decode(tokenizer.encode(PROMPT + choice.text)[completion.usage.prompt_tokens:])


def test_chat_stop_string_and_eos_give_finish_reason_stop(client, tokenizer):
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=200, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    assert full.usage.prompt_tokens == chat_prompt_tokens(tokenizer)
    if full.usage.completion_tokens < 200:  # the model ended its answer itself (EOS)
        assert full.choices[0].finish_reason == "stop"
    words = text.split()
    stop = " " + words[len(words) // 2]
    cut = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                         stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]
    short = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_sync_streaming_chat_matches_the_non_streaming_answer(client):
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_async_client_streaming_and_not(aclient, tokenizer):
    async def run():
        completion = await aclient.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=6,
                                                      temperature=0)
        stream = await aclient.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        chat = await aclient.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=5,
                                                     stream=True, stream_options={"include_usage": True}, seed=3)
        chat_chunks = [chunk async for chunk in chat]
        return completion, chunks, chat_chunks

    completion, chunks, chat_chunks = asyncio.run(run())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens == 6
    assert chat_chunks[-1].usage.completion_tokens == 5
    assert chat_chunks[-1].usage.prompt_tokens == chat_prompt_tokens(tokenizer)


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=DEFAULT_MODEL, prompt="word " * 1100, max_tokens=4)


def test_the_readme_curl_example_works_as_written(server):
    import json
    import re
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    command = next(block for block in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if block.startswith("curl"))
    command = command.replace("http://127.0.0.1:8000", server.url)   # the test server's free port
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    answer = json.loads(result.stdout)
    assert answer["choices"][0]["message"]["content"].startswith("The capital of France is Paris")
    assert answer["choices"][0]["finish_reason"] == "stop"


def _legacy_lists(logprobs) -> tuple[list, list, list, list]:
    return logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset


def test_echo_with_logprobs_scores_the_prompt_whole_and_streamed(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    n = len(prompt_ids)
    args = {"model": DEFAULT_MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    choice = client.completions.create(**args).choices[0]
    tokens, values, tops, offsets = _legacy_lists(choice.logprobs)
    assert choice.text.startswith(PROMPT) and len(tokens) == len(values) == len(tops) == len(offsets) == n + 3
    assert tokens[:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert values[0] is None and tops[0] is None   # the first token has nothing before it
    assert all(v <= 0 for v in values[1:]) and all(len(top) == 2 for top in tops[1:])
    assert offsets[0] == 0 and offsets[n] == len(PROMPT) and offsets == sorted(offsets)

    chunks = list(client.completions.create(**args, stream=True))
    echo = chunks[0].choices[0]   # the echoed prompt comes first, with the prompt's logprobs
    assert echo.text == PROMPT and echo.logprobs.tokens == tokens[:n]
    streamed = [sum((list(part) for part in parts), []) for parts in
                zip(*(_legacy_lists(c.choices[0].logprobs) for c in chunks), strict=True)]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert streamed[0] == tokens and streamed[2] == tops and streamed[3] == offsets
    assert streamed[1][0] is None and streamed[1][1:] == pytest.approx(values[1:], abs=1e-5)


def test_the_prompt_logprobs_of_a_greedy_continuation_are_the_logprobs_it_was_generated_with(client, tokenizer):
    """Echo the prompt extended by its greedy continuation, generating nothing (max_tokens 0): the
    continuation's prompt logprobs equal the logprobs its tokens had when generated, and each is the
    best of its position; the prompt's part equals the prompt's own."""
    prompt_ids = tokenizer.encode(PROMPT)
    n = len(prompt_ids)
    generated = client.completions.create(model=DEFAULT_MODEL, prompt=prompt_ids, max_tokens=4, temperature=0,
                                          logprobs=1).choices[0]
    pieces = [tokenizer.encode(text) for text in generated.logprobs.tokens]   # each token's text is that token
    assert all(len(piece) == 1 for piece in pieces), pieces
    extended = prompt_ids + [piece[0] for piece in pieces]
    echo = client.completions.create(model=DEFAULT_MODEL, prompt=extended, echo=True, logprobs=1, max_tokens=0)
    tokens, values, tops, _ = _legacy_lists(echo.choices[0].logprobs)
    assert echo.choices[0].text == tokenizer.decode(extended) and echo.choices[0].finish_reason == "length"
    assert echo.usage.completion_tokens == 0 and echo.usage.prompt_tokens == n + 4 and len(values) == n + 4
    assert values[n:] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-3)
    assert sum(values[n:]) == pytest.approx(sum(generated.logprobs.token_logprobs), abs=2e-3)
    assert all(max(top, key=top.get) == token for top, token in zip(tops[n:], tokens[n:], strict=True))
    alone = client.completions.create(model=DEFAULT_MODEL, prompt=prompt_ids, echo=True, logprobs=1, max_tokens=0)
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(values[1:n], abs=1e-3)


def test_max_tokens_0_echoes_the_prompt_alone_and_bad_combinations_name_their_field(client, tokenizer):
    chunks = list(client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, echo=True, max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Hello there")]   # token ids, two prompts
    batch = client.completions.create(model=DEFAULT_MODEL, prompt=prompts, echo=True, logprobs=0, max_tokens=0)
    for choice, prompt in zip(batch.choices, prompts, strict=True):
        assert choice.text == tokenizer.decode(prompt) and len(choice.logprobs.token_logprobs) == len(prompt)
        assert choice.logprobs.top_logprobs[1:] == [{}] * (len(prompt) - 1)
    for args, field in (({"max_tokens": 0}, "max_tokens"),
                        ({"echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
                        ({"echo": True, "max_tokens": 0, "extra_body": {"min_tokens": 1}}, "min_tokens")):
        with pytest.raises(openai.BadRequestError, match=field) as info:
            client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, **args)
        assert info.value.param == field


#: Resident memory of the default model's engine process beyond its weights and KV pool when start-up
#: ends (the interpreter, Paddle, MKL, the tokenizer, zmq, the warm-up's workspaces): 573 MiB measured
#: (AMD EPYC Zen 4, C++ kernels, 2026-12-07); the bound leaves room, and a second copy of the
#: projections (~405 MiB) would not fit in it.
ENGINE_RUNTIME_ALLOWANCE = 800 << 20


def test_metrics_report_the_engine_s_resident_memory_by_part(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text

    def gauge(name: str, labels: str = "") -> float:
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name}{labels} is missing from /metrics"
        return float(match.group(1))

    weights, kv_cache, runtime = (gauge("fd_memory_bytes", f'{{part="{part}"}}') for part in MEMORY_PARTS)
    resident = gauge("fd_memory_resident_bytes")
    assert weights + kv_cache + runtime == resident <= gauge("fd_memory_peak_resident_bytes")
    gguf = read_gguf(resolve_alias(DEFAULT_MODEL))
    shapes = {tensor.name: tensor.shape for tensor in gguf.tensors}
    arch = LlamaFamily().parse_gguf(gguf.metadata, shapes)
    pool = 256 * kv_cache_bytes_per_block(arch, load_config().cache.block_size)   # --cache.num_blocks 256
    assert pool <= kv_cache <= pool + 4 * arch.num_hidden_layers * mmap.PAGESIZE
    dense = 4 * sum(math.prod(shape) for shape in shapes.values())   # every weight once, in float32
    tied_head = 4 * math.prod(shapes["token_embd.weight"])   # the C++ head's packed copy of the embedding
    # beyond that: RoPE tables, MKL's padding, and huge pages under the packed weights where the heap had
    # numpy's (681 MiB against 628 MiB, from one start to the next)
    assert dense <= weights <= dense + tied_head + (128 << 20)
    assert resident <= weights + kv_cache + ENGINE_RUNTIME_ALLOWANCE
