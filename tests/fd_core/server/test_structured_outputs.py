"""Constrained decoding through the official ``openai`` client against fd-serve with the default model:
``response_format`` (``client.chat.completions.parse`` with pydantic models, ``json_object``), vLLM's
``guided_*`` and ``structured_outputs`` fields, ``logit_bias``, the 400s of bad constraints, and a
constraint on the answer after the reasoning: the server reads replies with the ``think`` reasoning
parser, so a reply may open ``<think>`` first (SmolLM2 does not, unless steered)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

import openai
import pydantic
import pytest

from fd_core.config import DEFAULT_MODEL
from fd_core.model.loader import load_tokenizer
from tests.fd_core.server.conftest import start_server
from tests.fd_core.server.test_tool_calls import ARGUMENTS, QUESTION, TOOLS

pytest.importorskip("xgrammar")


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=40)
    city: str = pydantic.Field(max_length=30)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    favourite_color: Color
    address: Address


class Inventory(pydantic.BaseModel):
    items: list[str] = pydantic.Field(min_length=1, max_length=4)
    total_price: float = pydantic.Field(ge=0, le=1000)
    in_stock: bool


CASES = [
    (Person, "Invent a person. Reply in JSON with name, age, favourite_color (red, green or blue) and an address "
             "(street, city, zip_code)."),
    (Inventory, "List a few fruits in a shop as JSON: items, total_price and in_stock."),
    (Person, "Who is Ada Lovelace? Answer as JSON."),
    (Inventory, "Describe the contents of a toolbox as JSON."),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("structured"), "--model.max_model_len", "1024",
                          "--cache.num_blocks", "256", "--reasoning_parser.name", "think", name="structured")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_parse_with_pydantic_models_always_validates_where_unconstrained_replies_mostly_do_not(client) -> None:
    def constrained(model: type[pydantic.BaseModel], prompt: str) -> None:
        completion = client.chat.completions.parse(model=DEFAULT_MODEL, messages=_chat(prompt), response_format=model,
                                                   max_tokens=200, temperature=0)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, model), message.content   # parse() validated it

    def free_reply_validates(model: type[pydantic.BaseModel], prompt: str) -> bool:
        free = client.chat.completions.create(model=DEFAULT_MODEL, messages=_chat(prompt), max_tokens=200,
                                              temperature=0).choices[0].message.content
        try:
            model.model_validate_json(free)
        except pydantic.ValidationError:
            return False
        return True

    # all at once: the engine batches them (sequentially they took most of this file's time)
    with ThreadPoolExecutor(2 * len(CASES)) as pool:
        checks = [pool.submit(constrained, *case) for case in CASES]
        free = [pool.submit(free_reply_validates, *case) for case in CASES]
        for check in checks:
            check.result()
        unconstrained = sum(reply.result() for reply in free)
    print(f"valid replies: {len(CASES)}/{len(CASES)} constrained, {unconstrained}/{len(CASES)} unconstrained")
    assert unconstrained < len(CASES)


def test_json_object_gives_a_json_object(client) -> None:
    prompt = "Reply with a JSON object holding the name and the age of a cat."
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=_chat(prompt),
                                           response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_streamed_schema_reply_reassembles_into_the_same_text(client) -> None:
    kwargs = {"model": DEFAULT_MODEL, "messages": _chat(CASES[0][1]), "max_tokens": 200, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "person",
                                                                         "schema": Person.model_json_schema()}}}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **kwargs, stream=True) if chunk.choices)
    assert streamed == whole
    Person.model_validate_json(streamed)


@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs"])
def test_a_regex_gives_an_exact_match(client, field) -> None:
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}-[0-9]{2}-[0-9]{2}"
    extra = {field: pattern} if field == "guided_regex" else {field: {"regex": pattern}}
    reply = client.completions.create(model=DEFAULT_MODEL, prompt="Name and birthday of a famous scientist:",
                                      max_tokens=40, temperature=0.8, seed=3, n=3, extra_body=extra)
    for choice in reply.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_a_choice_gives_one_of_the_choices(client) -> None:
    choices = ["positive", "negative", "neutral"]
    for review in ("I loved this film, wonderful!", "Terrible food, never again."):
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=_chat(f"Sentiment of: {review}"), max_tokens=10, temperature=0,
            extra_body={"guided_choice": choices})
        assert reply.choices[0].message.content in choices


def test_logit_bias_forces_and_forbids_tokens(client) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompt = "The capital of France is"
    free = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    greedy_first = tokenizer.encode(prompt + free)[len(tokenizer.encode(prompt))]
    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(banana): 100}).choices[0].text
    assert forced == tokenizer.decode([banana] * 4)
    avoided = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        logit_bias={str(greedy_first): -100}).choices[0].text
    assert tokenizer.encode(prompt + avoided)[len(tokenizer.encode(prompt))] != greedy_first


def test_bad_constraints_are_400s_naming_the_field(client) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format"),
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=DEFAULT_MODEL, messages=_chat("hi"), max_tokens=5,
                                           extra_body=extra)
        assert info.value.body["param"] == param, (extra, info.value.body)


class Verdict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def into_reasoning(server) -> dict[str, int]:
    """A logit bias that has SmolLM2 open <think> and soon close it (alone, it answers at once)."""
    import httpx

    def token(text: str) -> str:
        [token_id] = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
            "tokens"]
        return str(token_id)

    return {token("<"): 3, token("</"): 4}


def test_a_constraint_applies_to_the_answer_after_the_reasoning(client, into_reasoning) -> None:
    kwargs = {"model": DEFAULT_MODEL, "messages": _chat("Is the sun hot?"), "max_tokens": 60, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "verdict",
                                                                         "schema": Verdict.model_json_schema()}}}
    direct = client.chat.completions.create(**kwargs).choices[0].message
    assert not getattr(direct, "reasoning_content", None)
    Verdict.model_validate_json(direct.content)
    steered = client.chat.completions.create(**kwargs, logit_bias=into_reasoning).choices[0]
    assert steered.finish_reason == "stop" and steered.message.reasoning_content.strip()
    Verdict.model_validate_json(steered.message.content)   # the JSON follows </think>, whole
    reasoning = content = ""
    for chunk in client.chat.completions.create(**kwargs, logit_bias=into_reasoning, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (steered.message.reasoning_content, steered.message.content)


def test_required_tool_calls_follow_the_reasoning_too(client, into_reasoning) -> None:
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0,
                                           logit_bias=into_reasoning).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.reasoning_content.strip()
    assert not reply.message.content
    for call in reply.message.tool_calls:
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
