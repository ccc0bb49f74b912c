"""Guided decoding in the engine on a tiny random model: every output satisfies its constraint, a
continuation and a preempted request replay it, a dead end ends one request alone, bad constraints
are refused naming the field, and every KV block is free after each drain."""

from __future__ import annotations

import json
import re
from typing import Literal

import pydantic
import pytest

from fd_core.config import load_config
from fd_core.engine.builder import build_engine
from fd_core.errors import RequestError
from fd_core.request import GuidedDecoding, Request, SamplingParams

pytest.importorskip("xgrammar")

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: Literal["tool", "fruit", "toy"]
    count: int = pydantic.Field(ge=0, le=99)
    tags: list[Literal["a", "b"]] = pydantic.Field(max_length=3)


SCHEMA = GuidedDecoding("json", json.dumps(Item.model_json_schema()))
REGEX = GuidedDecoding("regex", r"[a-c]{2,5}-[0-9]{1,3}")


def _engine(tiny_model_dir, num_blocks: int = 64, **engine):
    return build_engine(load_config(model={"source": tiny_model_dir},
                                    cache={"num_blocks": num_blocks, "block_size": 16}, engine=engine))


def _drain(engine, requests: list[Request]) -> dict[str, tuple[list[int], str, str | None]]:
    """Request id -> (tokens, finish reason, error), once all finished (each ends on the model's eos ids)."""
    for request in requests:
        request.eos_token_ids = engine.tokenizer.eos_token_ids
        engine.add_request(request)
    done: dict[str, tuple[list[int], str, str | None]] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(2000):
        engine.step()
        for output in engine.get_results(timeout=0):
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                done[output.request_id] = (tokens[output.request_id], output.finish_reason.value, output.error)
        if len(done) == len(requests):
            assert engine.resource_manager.stats().num_free_blocks == engine.limits.num_blocks
            return done
    raise AssertionError(f"unfinished: {set(tokens) - set(done)}")


def test_sampled_outputs_satisfy_a_schema_and_a_regex(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    requests = [Request(f"s{seed}", PROMPT, SamplingParams(max_tokens=80, temperature=1.0, seed=seed, guided=guided))
                for seed in range(6) for guided in (SCHEMA, REGEX)]
    for request in requests:
        request.request_id += request.sampling_params.guided.kind
    results = _drain(engine, requests)
    for request in requests:
        tokens, reason, _ = results[request.request_id]
        text = engine.tokenizer.decode(tokens)
        assert reason == "stop", text
        if request.sampling_params.guided is SCHEMA:
            Item.model_validate_json(text)
        else:
            assert re.fullmatch(REGEX.spec, text), text


def test_a_continuation_replays_the_constraint_and_gives_the_rest(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_tokens=80, temperature=0.0, guided=SCHEMA)
    whole, reason, _ = _drain(engine, [Request("whole", PROMPT, params)])["whole"]
    assert reason == "stop"
    for cut in (1, len(whole) // 2, len(whole) - 1):
        continuation = Request(f"c{cut}", PROMPT, params, output_token_ids=whole[:cut])
        rest, rest_reason, _ = _drain(engine, [continuation])[continuation.request_id]
        assert whole[:cut] + rest == whole and rest_reason == "stop"


def test_preempted_requests_keep_their_constraint(tiny_model_dir) -> None:
    alone = _engine(tiny_model_dir)
    params = [SamplingParams(max_tokens=60, temperature=0.0, guided=SCHEMA if i % 2 else REGEX) for i in range(8)]
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(8)]
    expected = {f"r{i}": _drain(alone, [Request(f"r{i}", prompts[i], params[i])])[f"r{i}"] for i in range(8)}
    crowded = _engine(tiny_model_dir, num_blocks=6)   # 8 requests of up to 68 tokens in 6 blocks of 16
    got = _drain(crowded, [Request(f"r{i}", prompts[i], params[i]) for i in range(8)])
    assert crowded.resource_manager.stats().num_preemptions > 0
    assert got == expected


def test_a_constraint_complete_before_min_tokens_ends_that_request_alone(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    dead_end = Request("dead", PROMPT, SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0,
                                                      guided=GuidedDecoding("choice", '["ab"]')))
    other = Request("other", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    results = _drain(engine, [dead_end, other])
    assert results["dead"][1] == "error" and "min_tokens (10)" in results["dead"][2]
    assert results["other"][1] == "length" and len(results["other"][0]) == 12


def test_logit_bias_moves_the_greedy_choice(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    free, _, _ = _drain(engine, [Request("free", PROMPT, SamplingParams(max_tokens=4, temperature=0.0,
                                                                       ignore_eos=True))])["free"]
    forced_id = (free[0] + 1) % 512
    forced, _, _ = _drain(engine, [Request("forced", PROMPT, SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={forced_id: 100.0}))])["forced"]
    assert forced == [forced_id] * 4
    avoided, _, _ = _drain(engine, [Request("avoided", PROMPT, SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, logit_bias={free[0]: -100.0}))])["avoided"]
    assert avoided[0] != free[0]


@pytest.mark.parametrize(("params", "field", "words"), [
    (SamplingParams(guided=GuidedDecoding("regex", "a(")), "guided", "does not compile"),
    (SamplingParams(guided=GuidedDecoding("json", "{not json")), "guided", "not JSON"),
    (SamplingParams(guided=GuidedDecoding("choice", "[]")), "guided", "non-empty list"),
    (SamplingParams(guided=GuidedDecoding("xml", "<a/>")), "guided", "kind must be one of"),
    (SamplingParams(guided=REGEX, ignore_eos=True), "ignore_eos", "cannot be combined"),
    (SamplingParams(guided=GuidedDecoding("regex", "a", reasoning_start="<think>")), "guided",
     "reasoning_start needs reasoning_end"),
    (SamplingParams(guided=GuidedDecoding("regex", "a", reasoning_end="")), "guided", "reasoning_end must be 1 to 64"),
    (SamplingParams(logit_bias={512: 1.0}), "logit_bias", "outside the vocabulary"),
    (SamplingParams(logit_bias={1: 100.5}), "logit_bias", "[-100, 100]"),
])
def test_bad_constraints_and_biases_are_refused_naming_the_field(tiny_model_dir, params, field, words) -> None:
    engine = _engine(tiny_model_dir)
    with pytest.raises(RequestError) as info:
        engine.add_request(Request("bad", PROMPT, params))
    assert info.value.field == field and words in str(info.value)
    assert not engine.has_unfinished()


# --- a constraint on the answer after the reasoning ------------------------------------------------------

CHOICE = '["ab", "cd"]'


def _free_run_and_tag(engine) -> tuple[list[int], int, str]:
    """The greedy unconstrained tokens, the index of the token that first completes a two-token tag
    written there (at least 3 tokens in), and that tag."""
    free, _, _ = _drain(engine, [Request("free", PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                                        ignore_eos=True))])["free"]
    table = engine.tokenizer.token_bytes()
    for end in range(3, len(free)):
        tag = table[free[end - 1]] + table[free[end]]
        text = b"".join(table[t] for t in free[:end + 1])
        if text.find(tag) + len(tag) == len(text) and tag.decode("utf-8", "replace").isprintable():
            return free, end, tag.decode()
    raise AssertionError(f"no tag in the free run {free}")


def test_a_constraint_after_the_reasoning_leaves_the_reasoning_free_and_holds_the_answer(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    free, end, tag = _free_run_and_tag(engine)
    reasoning = engine.tokenizer.decode(free[:end + 1])
    assert not any(choice.startswith(reasoning[:1]) for choice in json.loads(CHOICE))   # the choice forbids it
    opened_by = engine.tokenizer.decode(free[:1])
    for guided in (GuidedDecoding("choice", CHOICE, reasoning_end=tag),                     # the reply reasons first
                   GuidedDecoding("choice", CHOICE, reasoning_end=tag, reasoning_start=opened_by)):   # it opens it
        tokens, reason, _ = _drain(engine, [Request("r", PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                guided=guided))])["r"]
        assert tokens[:end + 1] == free[:end + 1] and reason == "stop"
        assert engine.tokenizer.decode(tokens[end + 1:]) in json.loads(CHOICE)


def test_a_reply_that_does_not_open_or_never_ends_its_reasoning(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    plain, _, _ = _drain(engine, [Request("plain", PROMPT, SamplingParams(
        max_tokens=12, temperature=0.0, guided=GuidedDecoding("choice", CHOICE)))])["plain"]
    not_opened, _, _ = _drain(engine, [Request("not-opened", PROMPT, SamplingParams(
        max_tokens=12, temperature=0.0, guided=GuidedDecoding("choice", CHOICE, reasoning_end="</x>",
                                                              reasoning_start="\x01")))])["not-opened"]
    assert not_opened == plain   # constrained from its first token
    free, reason, _ = _drain(engine, [Request("free", PROMPT, SamplingParams(max_tokens=12, temperature=0.0))])["free"]
    never, never_reason, _ = _drain(engine, [Request("never", PROMPT, SamplingParams(
        max_tokens=12, temperature=0.0, guided=GuidedDecoding("choice", CHOICE, reasoning_end="</x>")))])["never"]
    assert (never, never_reason) == (free, reason)   # no mask at all: the tag never came
    assert engine.tokenizer.decode(free) not in json.loads(CHOICE)


def test_replays_from_the_delivered_tokens_make_the_same_mask_decisions(tiny_model_dir) -> None:
    import numpy as np

    from fd_core.runner.constraints import Constraints

    engine = _engine(tiny_model_dir)
    free, end, tag = _free_run_and_tag(engine)
    guided = GuidedDecoding("choice", CHOICE, reasoning_end=tag, reasoning_start=engine.tokenizer.decode(free[:1]))
    params = SamplingParams(max_tokens=12, temperature=0.0, guided=guided)
    whole, _, _ = _drain(engine, [Request("whole", PROMPT, params)])["whole"]
    for cut in range(1, len(whole)):   # a continuation re-served from every point: the rest is the same
        rest, reason, _ = _drain(engine, [Request(f"c{cut}", PROMPT, params, output_token_ids=whole[:cut])])[f"c{cut}"]
        assert whole[:cut] + rest == whole and reason == "stop"
    live, request = engine.constraints, Request("m", PROMPT, params, eos_token_ids=engine.tokenizer.eos_token_ids)
    allowed = []
    for n in range(len(whole)):
        request.output_token_ids = whole[:n]
        logits = [np.zeros((1, live.vocab_size), dtype=np.float32) for _ in range(2)]
        live.mask(logits[0], [request])   # the same matcher, step after step
        Constraints(live.backend, vocab_size=live.vocab_size, token_bytes=live.token_bytes).mask(logits[1], [request])
        assert np.array_equal(np.isfinite(logits[0]), np.isfinite(logits[1])), n
        allowed.append(int(np.isfinite(logits[0]).sum()))
    # opening: the choice's and the tag's first tokens; reasoning: (almost) everything; the answer: the choice
    assert allowed[0] < 20 and min(allowed[1:end + 1]) > live.vocab_size - 20 and max(allowed[end + 1:]) < 20
