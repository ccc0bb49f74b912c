"""The default token processor: stop rules, streamed text, logprobs, metrics and finish reporting."""

from __future__ import annotations

from importlib.metadata import entry_points

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.outputs import SampledToken, ScheduledRequest, StepPlan, StepResult
from fd_core.request import FinishReason, RequestStatus
from fd_plugins.token_processors.default import DefaultTokenProcessor, DefaultTokenProcessorSettings
from fd_plugins.token_processors.detokenizer import REPLACEMENT_CHAR

EOS = 2
STOP_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_registered_under_its_entry_point():
    (ep,) = [ep for ep in entry_points(group="fd.token_processors") if ep.name == "default"]
    assert ep.load() is DefaultTokenProcessor
    assert DefaultTokenProcessor.name == "default" and DefaultTokenProcessor.fd_hookspec_version == FD_HOOKSPEC_VERSION


def test_settings_reject_unknown_keys():
    with pytest.raises(pydantic.ValidationError, match="skip_special"):
        DefaultTokenProcessorSettings(skip_special=False)


def test_eos_stops_and_adds_no_text(harness):
    tp = harness.processor()
    request = harness.request()
    outputs = harness.drive(tp, request, [*harness.encode("hello"), EOS, 9])
    last = outputs[-1]
    assert last.finished and last.finish_reason is FinishReason.STOP
    assert last.new_token_ids == [EOS] and last.new_text == ""
    assert harness.text(outputs) == "hello"
    assert request.output_token_ids[-1] == EOS
    # the processor only reports the finish; the engine core ends the request
    assert request.status is RequestStatus.WAITING and request.finish_reason is None
    assert request.finished_time is None
    assert [o.finished for o in outputs].count(True) == 1


def test_eos_with_special_tokens_kept_still_adds_no_text(harness):
    tp = harness.processor(skip_special_tokens=False)
    outputs = harness.drive(tp, harness.request(), [1, *harness.encode("hi"), EOS])
    assert harness.text(outputs) == "<|im_start|>hi"


def test_stop_token_ids_stop(harness):
    ids = harness.encode("one two")
    tp = harness.processor()
    outputs = harness.drive(tp, harness.request(stop_token_ids=[ids[1]]), ids)
    assert len(outputs) == 2 and outputs[-1].finish_reason is FinishReason.STOP
    assert harness.text(outputs) == harness.tokenizer.decode(ids[:1])


def test_ignore_eos_runs_to_max_tokens(harness):
    tp = harness.processor()
    outputs = harness.drive(tp, harness.request(ignore_eos=True, max_tokens=4), [EOS, 7, EOS, 8, 9])
    assert len(outputs) == 4 and outputs[-1].finish_reason is FinishReason.LENGTH
    assert [o.new_token_ids[0] for o in outputs] == [EOS, 7, EOS, 8]


def test_max_tokens_finishes_with_length(harness):
    ids = harness.encode("a b c d e f")
    outputs = harness.drive(harness.processor(), harness.request(max_tokens=3), ids)
    assert len(outputs) == 3 and outputs[-1].finish_reason is FinishReason.LENGTH
    assert harness.text(outputs) == harness.tokenizer.decode(ids[:3])
    assert outputs[-1].num_output_tokens == 3


def test_max_model_len_finishes_with_length(harness):
    tp = harness.processor(max_model_len=5)
    outputs = harness.drive(tp, harness.request(prompt=[5, 6, 7]), harness.encode("a b c d"))
    assert len(outputs) == 2 and outputs[-1].finish_reason is FinishReason.LENGTH


def test_min_tokens_suppresses_eos_until_reached(harness):
    tp = harness.processor()
    request = harness.request(min_tokens=3)
    outputs = harness.drive(tp, request, [EOS, EOS, 7, EOS, 8])
    # The first two eos are ordinary tokens; the fourth output is the first eos that counts.
    assert len(outputs) == 4 and outputs[-1].finish_reason is FinishReason.STOP
    assert request.output_token_ids == [EOS, EOS, 7, EOS]
    assert harness.text(outputs) == harness.tokenizer.decode([EOS, EOS, 7])


def test_min_tokens_token_that_reaches_it_may_stop(harness):
    outputs = harness.drive(harness.processor(), harness.request(min_tokens=2), [7, EOS, 8])
    assert len(outputs) == 2 and outputs[-1].finish_reason is FinishReason.STOP


def test_min_tokens_suppresses_stop_strings(harness):
    ids = harness.encode("x END y END z")
    n_first = len(harness.encode("x END"))
    tp = harness.processor()
    outputs = harness.drive(tp, harness.request(stop=["END"], min_tokens=n_first + 1), ids)
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert harness.text(outputs) == "x END y "


def test_stop_string_across_tokens_never_leaks(harness):
    ids = harness.encode("Hello, world! How are you")
    tp = harness.processor()
    outputs = harness.drive(tp, harness.request(stop=["world!"]), ids)
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.STOP
    assert harness.text(outputs) == "Hello, "
    assert all("w" not in o.new_text for o in outputs)


def test_stop_string_included_when_asked(harness):
    ids = harness.encode("Hello, world! How are you")
    tp = harness.processor()
    outputs = harness.drive(tp, harness.request(stop=["world!"], include_stop_str_in_output=True), ids)
    assert harness.text(outputs) == "Hello, world!"
    assert all("w" not in o.new_text for o in outputs[:-1])


def test_stop_string_inside_an_emoji_sequence(harness):
    ids = harness.encode("ab😀🎉cd")
    outputs = harness.drive(harness.processor(), harness.request(stop=["🎉"]), ids)
    assert harness.text(outputs) == "ab😀" and outputs[-1].finish_reason is FinishReason.STOP


def test_held_back_text_is_flushed_at_length(harness):
    ids = harness.encode("say END")
    cut = len(harness.encode("say EN"))
    outputs = harness.drive(harness.processor(), harness.request(stop=["END"], max_tokens=cut), ids)
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert harness.text(outputs) == harness.tokenizer.decode(ids[:cut])


def test_logprobs_pass_through_only_when_asked(harness):
    tp = harness.processor()
    with_lp, without = harness.request("a", logprobs=2), harness.request("b")
    tp.add_request(with_lp)
    tp.add_request(without)
    token = SampledToken(7, -0.1, [(7, -0.1), (8, -2.5)])
    outputs = {o.request_id: o for o in harness.step(tp, {with_lp: token, without: SampledToken(7, -0.1)})}
    assert outputs["a"].new_logprobs == [token]
    assert outputs["b"].new_logprobs == []


def test_output_counts(harness):
    tp = harness.processor()
    request = harness.request(prompt=[5, 6, 7, 8])
    request.num_cached_tokens = 2
    outputs = harness.drive(tp, request, [7, 8])
    assert [(o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens) for o in outputs] == [(4, 1, 2), (4, 2, 2)]


def test_finishes_are_reported_in_the_outputs_of_their_step(harness):
    tp = harness.processor()
    a, b, c, d = (harness.request(i, max_tokens=2 if i == "c" else 10) for i in "abcd")
    for r in (a, b, c, d):
        tp.add_request(r)
    harness.step(tp, {a: 7, b: 7, c: 7, d: 7})
    outputs = harness.step(tp, {a: EOS, b: EOS, c: 7, d: 7})
    assert {o.request_id: o.finish_reason for o in outputs if o.finished} == {
        "a": FinishReason.STOP, "b": FinishReason.STOP, "c": FinishReason.LENGTH}
    assert all(r.status is RequestStatus.WAITING for r in (a, b, c, d))   # nothing ended here
    assert [o.finish_reason for o in harness.step(tp, {d: EOS})] == [FinishReason.STOP]


def test_forget_drops_held_back_text_and_state(harness):
    tp = harness.processor()
    request = harness.request(stop=["END"])
    outputs = harness.drive(tp, request, harness.encode("so EN"))
    assert harness.text(outputs) == "so "   # "EN" is held back: it may start "END"
    tp.forget(request.request_id)
    tp.forget(request.request_id)   # forgetting twice is harmless
    assert request.request_id not in tp._states
    # a new request under the same id starts from scratch: no "EN" left over from the first
    again = harness.request(stop=["END"])
    assert harness.text(harness.drive(tp, again, [*harness.encode("ok"), EOS])) == "ok"


def test_rows_without_a_sample_produce_nothing(harness):
    tp = harness.processor()
    request = harness.request()
    tp.add_request(request)
    assert tp.process(StepPlan.make_empty(), StepResult.make_empty()) == []
    plan = StepPlan([ScheduledRequest(request, 0, 2, [], False)], [], 2)
    assert tp.process(plan, StepResult.make_empty()) == []
    assert request.output_token_ids == [] and request.first_token_time is None


def test_preempted_request_continues_its_text_after_recompute(harness):
    tp = harness.processor()
    request = harness.request(stop=["END"])
    ids = harness.encode("one 😀 two END")
    outputs = harness.drive(tp, request, ids[:3])
    # Preempted: the plan lists it, then it is recomputed from scratch in one prefill row.
    assert tp.process(StepPlan([], [request.request_id], 0), StepResult.make_empty()) == []
    request.num_computed_tokens = 0
    for token_id in ids[3:]:
        row = ScheduledRequest(request, 0, request.num_tokens, [], True)
        (output,) = tp.process(StepPlan([row], [], row.num_new_tokens), StepResult({"r0": SampledToken(token_id)}))
        outputs.append(output)
        if output.finished:
            break
    assert harness.text(outputs) == "one 😀 two " and outputs[-1].finish_reason is FinishReason.STOP


def test_first_token_metrics(harness):
    tp = harness.processor()
    request = harness.request(max_tokens=3)
    request.arrival_time -= 1.0
    request.scheduled_time = request.arrival_time + 0.25
    outputs = harness.drive(tp, request, [7, 8, 9])
    first, middle, last = outputs
    m = first.metrics
    assert m.arrival_time == request.arrival_time and m.queue_time == pytest.approx(0.25)
    assert 0 <= m.queue_time <= m.ttft and m.e2e is None
    assert middle.metrics is None
    assert last.finished and last.metrics is None   # the engine core fills the final output's metrics


@STOP_SETTINGS
@given(data=st.data(), ids=st.lists(st.integers(3, 511), min_size=1, max_size=30), include=st.booleans())
def test_random_tokens_and_stops_stream_the_reference_text(harness, data, ids, include):
    """Deltas add up to decode(ids) cut at the first-ending stop string, and never leak it."""
    full = harness.tokenizer.decode(ids)
    clean = full.replace(REPLACEMENT_CHAR, "")
    stops = data.draw(st.lists(st.one_of(
        st.builds(lambda a, n: clean[a:a + n], st.integers(0, max(0, len(clean) - 1)), st.integers(1, 4)),
        st.text(st.sampled_from("ab 😀你"), min_size=1, max_size=3)), max_size=2))
    stops = [s for s in stops if s]
    tp = harness.processor()
    outputs = harness.drive(tp, harness.request(stop=stops, include_stop_str_in_output=include,
                                                max_tokens=len(ids)), ids)
    matches = [(i + len(s), i) for s in stops for i in range(len(full)) if full.startswith(s, i)]
    assert outputs[-1].finished and [o.finished for o in outputs].count(True) == 1
    if matches:
        end, start = min(matches)
        assert outputs[-1].finish_reason is FinishReason.STOP
        assert harness.text(outputs) == full[:end if include else start]
        assert len(harness.text(outputs[:-1])) <= start   # nothing of the stop string before the end
    else:
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert harness.text(outputs) == full
    for k in range(1, len(outputs) + 1):   # no replacement char goes out ahead of its place
        assert full.startswith(harness.text(outputs[:k]))
