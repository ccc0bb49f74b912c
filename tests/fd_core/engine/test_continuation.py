"""A continuation (a request handed out with output tokens already delivered) goes on exactly
where an uninterrupted run would: same next tokens, and text across the splice as if unbroken."""

from __future__ import annotations

import pytest

from fd_core.config import load_config
from fd_core.engine.builder import build_engine
from fd_core.request import Request, SamplingParams

PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]


def _engine(tiny_model_dir, manager: str):
    return build_engine(load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 64},
                                    resource_manager={"name": manager}))


def _run(engine, request: Request) -> tuple[list[int], list[str], str]:
    """Token ids, the text of each output, and the finish reason."""
    engine.add_request(request)
    tokens: list[int] = []
    texts: list[str] = []
    for _ in range(200):
        engine.step()
        for output in engine.get_results(timeout=0):
            tokens += output.new_token_ids
            texts.append(output.new_text)
            if output.finished:
                return tokens, texts, output.finish_reason.value
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("manager", ["v0", "v1"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_continuation_gives_the_rest_of_an_uninterrupted_run(tiny_model_dir, manager: str, cut: int) -> None:
    engine = _engine(tiny_model_dir, manager)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    whole, whole_texts, reason = _run(engine, Request("whole", PROMPT, params))
    rest, rest_texts, rest_reason = _run(engine, Request("cont", PROMPT, params, output_token_ids=whole[:cut]))
    assert whole[:cut] + rest == whole and rest_reason == reason == "length"
    assert "".join(whole_texts[:cut] + rest_texts) == "".join(whole_texts)

    # a stop string spanning the splice (the text of tokens cut-1 .. cut+1): the first holder
    # emitted the text of its first `cut` outputs, part of it held back; the rest must follow exactly
    stop = engine.tokenizer.decode(whole[cut - 1:cut + 2])
    stopped = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    ref, ref_texts, ref_reason = _run(engine, Request("ref", PROMPT, stopped))
    assert ref_reason == "stop" and len(ref) > cut
    cont, cont_texts, cont_reason = _run(engine, Request("cont-stop", PROMPT, stopped, output_token_ids=ref[:cut]))
    assert ref[:cut] + cont == ref and cont_reason == "stop"
    assert "".join(ref_texts[:cut] + cont_texts) == "".join(ref_texts)
    assert engine.resource_manager.stats().num_free_blocks == engine.limits.num_blocks


@pytest.mark.parametrize(("prompt", "max_tokens", "field"), [
    ([5, 99999, 7], 4, "prompt"),        # an id outside this model's vocabulary
    (PROMPT, 64 * 16, "max_tokens"),     # more KV blocks than this instance's pool holds
])
def test_a_request_from_elsewhere_that_cannot_be_served_here_ends_alone(tiny_model_dir, prompt, max_tokens,
                                                                        field) -> None:
    """A request a scheduler hands out without the front door's checks (a pool member's take from a
    peer with other limits) ends with an error naming the field; the others of the step run on."""
    engine = _engine(tiny_model_dir, "v1")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.scheduler.put_request(Request("foreign", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    engine.add_request(Request("good", PROMPT, params))
    finals = {}
    for _ in range(50):
        engine.step()
        finals |= {o.request_id: o for o in engine.get_results(timeout=0) if o.finished}
        if len(finals) == 2:
            break
    assert finals["foreign"].finish_reason.value == "error"
    assert f"cannot serve the request ({field})" in finals["foreign"].error
    assert finals["good"].finish_reason.value == "length" and finals["good"].num_output_tokens == 4
    assert engine.resource_manager.stats().num_free_blocks == engine.limits.num_blocks
