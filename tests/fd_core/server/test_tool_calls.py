"""Tool calling and reasoning through the official ``openai`` client: ``tool_choice`` ``required`` and a
named function on the default model (enforced by a constraint, so any model's calls validate), a tool
result in the next turn, and on a tiny model whose chat template is Qwen3's kind, ``auto`` calls and
``<think>`` reasoning read out of replies (forced here with a regex), whole and streamed, and where a
constraint starts: after the reasoning, or from the first token when the prompt closed the reasoning."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest

from fd_core.config import DEFAULT_MODEL
from fd_core.testing.tiny_model import make_tiny_llama
from tests.fd_core.server.conftest import TINY_ARGS, start_server

pytest.importorskip("xgrammar")


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


class Time(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    timezone: str = pydantic.Field(pattern=r"^[A-Z][a-z]+/[A-Z][a-z]+$")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                      "parameters": Time.model_json_schema()}},
]
ARGUMENTS = {"get_weather": Weather, "get_time": Time}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Europe/Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tools"), "--model.max_model_len", "1024", "--cache.num_blocks",
                          "256", name="tools")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert server.stop() == 0, server.log()


def _validated(calls) -> list[str]:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
    return [call.function.name for call in calls]


def test_required_gives_calls_whose_arguments_validate(client) -> None:
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice="required", max_tokens=200, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert set(_validated(choice.message.tool_calls)) <= {"get_weather", "get_time"}


def test_a_named_function_gives_one_call_to_it_and_single_calls_without_parallel(client) -> None:
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, tools=TOOLS, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0)
    assert _validated(reply.choices[0].message.tool_calls) == ["get_time"]
    single = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                            tool_choice="required", parallel_tool_calls=False, temperature=0.8,
                                            seed=5, n=3)
    for choice in single.choices:
        assert len(_validated(choice.message.tool_calls)) == 1


def test_a_streamed_call_reassembles_into_the_same_call(client) -> None:
    kwargs = {"model": DEFAULT_MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
              "max_tokens": 200, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                for c in whole]
    assert reasons[-1] == "tool_calls"


def test_a_tool_result_in_the_next_turn_is_answered(client) -> None:
    first = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, tools=TOOLS, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=30, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),   # auto, and this model's template matches no tool parser
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_tool_misuse_is_a_400_naming_the_field(client, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body


def test_a_tool_message_without_its_call_id_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=5,
                                       messages=[*QUESTION, {"role": "tool", "content": "21"}])
    assert info.value.body["param"].endswith("tool_call_id")


# --- auto: the model's own call format, and its reasoning, read out of the reply --------------------------

QWEN_LIKE_TEMPLATE = (
    "{#- a thinking model: it writes <think>...</think> first, unless enable_thinking is false #}"
    "{%- if tools %}<|im_start|>system\nCall tools as <tool_call>JSON</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{%- endif %}")
FORCED = (r'<think>\nThe user wants the weather\.\n</think>\n\n'
          r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>')
#: A constraint is on the answer after the reasoning; where the prompt closed the reasoning (thinking off),
#: it holds from the first token, so a regex can force a whole reply, <think> block and all, for the parsers.
WHOLE_REPLY = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tiny_client(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-qwen") / "model", vocab=512, max_position_embeddings=512)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_LIKE_TEMPLATE}))
    server = start_server(tmp_path_factory.mktemp("tiny-tools"), "--model.source", str(folder), *TINY_ARGS,
                          name="tiny-tools")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert server.stop() == 0, server.log()


def test_auto_reads_the_model_s_calls_and_reasoning_whole_and_streamed(tiny_client) -> None:
    kwargs = {"model": tiny_client.models.list().data[0].id, "messages": QUESTION, "tools": TOOLS,
              "max_tokens": 150, "temperature": 0, "extra_body": {"guided_regex": FORCED, **WHOLE_REPLY}}
    message = tiny_client.chat.completions.create(**kwargs).choices[0]
    assert message.finish_reason == "tool_calls"
    assert message.message.reasoning_content.strip() == "The user wants the weather."
    assert not (message.message.content or "").strip()
    [call] = message.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                          {"city": "Paris", "unit": "celsius"})
    reasoning, content, calls, reasons = "", "", [], []
    for chunk in tiny_client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or ()]
            reasons.append(choice.finish_reason)
    assert reasoning == message.message.reasoning_content and content.strip() == ""
    assert calls == [(call.function.name, call.function.arguments)] and reasons[-1] == "tool_calls"


def test_reasoning_is_split_from_a_plain_answer(tiny_client) -> None:
    reply = tiny_client.chat.completions.create(
        model=tiny_client.models.list().data[0].id, messages=QUESTION, max_tokens=80, temperature=0,
        extra_body={"guided_regex": r"<think>\nShort\.\n</think>\n\nIt is sunny\.", **WHOLE_REPLY}).choices[0]
    assert reply.finish_reason == "stop"
    assert reply.message.reasoning_content.strip() == "Short." and reply.message.content.strip() == "It is sunny."


def test_a_constraint_holds_from_the_first_token_only_where_the_prompt_closed_the_reasoning(tiny_client) -> None:
    import httpx

    base = str(tiny_client.base_url).removesuffix("/v1/")
    [angle] = httpx.post(f"{base}/tokenize", json={"prompt": "<", "add_special_tokens": False}).json()["tokens"]
    choices = ["sunny", "rainy"]
    kwargs = {"model": tiny_client.models.list().data[0].id, "messages": QUESTION, "max_tokens": 12,
              "temperature": 0, "logit_bias": {str(angle): 100}}   # pushes towards "<", which no choice begins with
    closed = tiny_client.chat.completions.create(**kwargs, extra_body={"guided_choice": choices, **WHOLE_REPLY})
    message = closed.choices[0].message
    assert message.content in choices and not getattr(message, "reasoning_content", None)
    # thinking on: the reply may open its reasoning; the bias opens it, and the choice does not hold there
    opened = tiny_client.chat.completions.create(**kwargs, extra_body={"guided_choice": choices}).choices[0]
    assert opened.finish_reason == "length" and not opened.message.content
    assert opened.message.reasoning_content.startswith("<")


def test_tokenize_and_detokenize_agree_with_the_chat_endpoint(client) -> None:
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    counted = httpx.post(f"{base}/tokenize", json={"messages": QUESTION}).json()
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=1)
    assert counted["count"] == len(counted["tokens"]) == reply.usage.prompt_tokens
    text = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                                "return_token_strs": True}).json()
    assert "".join(text["token_strs"]) == "Hello world"
    assert httpx.post(f"{base}/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "Hello world"}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{base}/tokenize", json={"prompt": "a", "messages": QUESTION})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
