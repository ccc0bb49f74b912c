"""Conformance kit for TokenProcessor plugins: stops, lengths, detokenization and finishes, by hand.

The kit plays the engine core: it hands the processor hand-made :class:`~fd_core.outputs.StepPlan`
and :class:`~fd_core.outputs.StepResult` for scripted requests (one sampled token per step), ends
each request the step its finish is reported (status, ``forget``) and compares what came out with
what the tokenizer says the text is. The tokenizer is the tiny byte-level BPE that
:func:`fd_core.testing.tiny_model.make_tiny_llama` writes, so a CJK character or an emoji spans
several tokens. Use it from a plugin's own pytest, no model or device needed::

    from fd_core.testing.conformance import check_token_processor

    def test_my_processor_conforms():
        check_token_processor(MyTokenProcessor)
        check_token_processor(lambda tokenizer, max_model_len: MyTokenProcessor(
            None, tokenizer=tokenizer, max_model_len=max_model_len))

See :data:`TOKEN_PROCESSOR_CHECKS` for the invariants.
"""

from __future__ import annotations

import functools
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from fd_core.outputs import SampledToken, ScheduledRequest, StepPlan, StepResult
from fd_core.request import FinishReason, Request, RequestStatus, SamplingParams
from fd_core.testing.conformance._factories import describe, plugin_settings
from fd_core.testing.conformance._report import (
    Check,
    ConformanceError,
    SeamReport,
    broken,
    run_checks,
)

if TYPE_CHECKING:
    from fd_core.contracts.token_processor import TokenProcessor
    from fd_core.model.tokenizer import Tokenizer
    from fd_core.outputs import RequestOutput

__all__ = ["TOKEN_PROCESSOR_CHECKS", "TokenProcessorFactory", "check_token_processor",
           "run_token_processor_checks", "tiny_tokenizer"]

SEAM: Final = "token_processor"
#: ``factory(tokenizer, max_model_len)``: a new token processor, as the engine builds one.
TokenProcessorFactory = Callable[[object, int], "TokenProcessor"]
#: The max_model_len processors are built with.
MAX_MODEL_LEN: Final = 64
#: What a lossy UTF-8 decode puts where a character is incomplete.
REPLACEMENT_CHAR: Final = "\ufffd"

ONE_OUTPUT: Final = "one output per sampled token, none for rows without one"
BOOKKEEPING: Final = "process only appends the sampled token to the request"
REPORTS: Final = "a finish is reported by finished=True with finish reason stop or length"
ONE_FINISH: Final = "at most one finishing output per request, nothing after it"
EOS: Final = "stops on eos, unless ignore_eos"
STOP_IDS: Final = "stops on stop_token_ids"
STOP_STRINGS: Final = "stop strings match across tokens; the text ends at the match"
MIN_TOKENS: Final = "stops are ignored before min_tokens"
MAX_TOKENS: Final = "max_tokens finishes with length"
MAX_MODEL_LEN_INV: Final = "max_model_len finishes with length"
DETOKENIZE: Final = "deltas concatenate to the text and never split a character"
BATCH: Final = "requests of one batch do not affect each other"
FORGET: Final = "forget drops every trace of a request"
CONTINUATION: Final = "a continuation goes on exactly where the earlier holder stopped"
LOGPROBS: Final = "logprobs are attached when asked for"

#: Texts the cases are made of (the tiny tokenizer was trained on similar ones).
_SENTENCE: Final = " The quick brown fox jumps over the lazy dog again"
_MULTIBYTE: Final = " crab 🦀 and kanji 漢字, sum ∑ ok"
_TWO_FOXES: Final = " fox jumps over the lazy fox and the dog"


def check_token_processor(plugin: type[TokenProcessor] | TokenProcessorFactory, *,
                          options: Mapping[str, Any] | None = None, tokenizer: Tokenizer | None = None,
                          skip: Collection[str] = ()) -> SeamReport:
    """Run every token processor check; return the report, or raise ConformanceError naming the
    broken invariants.

    ``plugin`` is a TokenProcessor class (built with ``settings_model`` validated from
    ``options``) or a ``factory(tokenizer, max_model_len)``; ``tokenizer`` defaults to
    :func:`tiny_tokenizer`.
    """
    return run_token_processor_checks(plugin, options=options, tokenizer=tokenizer, skip=skip).raise_for_failures()


def run_token_processor_checks(plugin: type[TokenProcessor] | TokenProcessorFactory, *,
                               options: Mapping[str, Any] | None = None, tokenizer: Tokenizer | None = None,
                               skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_token_processor`, but never raises for a broken invariant: every check gets a row."""
    if isinstance(plugin, type):
        settings = plugin_settings(plugin, options)

        def factory(tok: Tokenizer, max_model_len: int) -> TokenProcessor:
            return plugin(settings, tokenizer=tok, max_model_len=max_model_len)
    elif options:
        raise ValueError("options are for a TokenProcessor class; a factory builds its own settings")
    else:
        factory = plugin
    kit = _Kit(factory, tokenizer or tiny_tokenizer())
    return run_checks(SEAM, describe(plugin), TOKEN_PROCESSOR_CHECKS, skip=skip, args=(kit,))


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Tokenizer:
    """The byte-level BPE of :func:`~fd_core.testing.tiny_model.make_tiny_llama`, loaded as the
    engine loads a model folder's (``fd_core.model.tokenizer.Tokenizer.from_folder``)."""
    from fd_core.model.tokenizer import Tokenizer
    from fd_core.testing.tiny_model import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="fd-conformance-") as folder:
        make_tiny_llama(folder, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=32)
        return Tokenizer.from_folder(folder)


@dataclass(slots=True)
class _Case:
    """One scripted request and what must come out of it."""

    name: str                      # how messages name the case
    request: Request
    script: list[int]              # the output tokens the "model" samples, in order
    invariant: str                 # what a wrong finish or text breaks
    finish_at: int | None = None   # 1-based output that must report the finish; None: none within the script
    reason: FinishReason | None = None
    text: str | None = None        # the deltas' concatenation; None: not compared
    texts: tuple[str, ...] = ()    # alternatives to ``text`` that are also right
    chunked: bool = False          # first step: a prefill chunk without a sampled token
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def joined(self) -> str:
        return "".join(o.new_text for o in self.outputs)


class _Kit:
    def __init__(self, factory: TokenProcessorFactory, tokenizer: Tokenizer) -> None:
        self.factory = factory
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_ids
        assert eos, "the kit's tokenizer must have an eos token"
        self.eos = eos[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def processor(self, max_model_len: int = MAX_MODEL_LEN) -> TokenProcessor:
        return self.factory(self.tokenizer, max_model_len)

    def request(self, request_id: str, params: SamplingParams, *, prompt: list[int] | None = None,
                outputs: list[int] | None = None) -> Request:
        return Request(request_id, prompt or self.encode("Hello, world!"), params, eos_token_ids=(self.eos,),
                       output_token_ids=list(outputs or []))

    def stop_cut(self, script: list[int], stop: str, *, include: bool, after: int = 0) -> tuple[int, str]:
        """(the output completing the first match of ``stop`` that ends after output ``after``, the
        text cut at that match): the kit's own expectation, from whole decodes."""
        base = len(self.decode(script[:after]))
        for k in range(after + 1, len(script) + 1):
            text = self.decode(script[:k])
            start = text.find(stop, max(0, base - len(stop) + 1))
            if start >= 0:
                return k, text[:start + len(stop)] if include else text[:start]
        raise AssertionError(f"the kit's script never contains {stop!r}")


def _drive(kit: _Kit, processor: TokenProcessor, cases: list[_Case]) -> None:
    """Feed every case its script, one token per step, all in one batch; end each as the core would."""
    live: dict[str, _Case] = {}
    for case in cases:
        case.request.status = RequestStatus.RUNNING
        processor.add_request(case.request)
        live[case.request_id] = case
    first = True
    step = 0
    while live:
        rows, sampled = [], {}
        for case in live.values():
            request, fed = case.request, len(case.outputs)
            if first and case.chunked:   # a prefill chunk that does not reach the end: nothing sampled
                rows.append(ScheduledRequest(request, 0, max(1, request.num_prompt_tokens - 1), [], sample=False))
                continue
            if fed >= len(case.script):
                continue
            token = case.script[fed]
            start = request.num_tokens - 1 if request.output_token_ids else 0
            rows.append(ScheduledRequest(request, start, request.num_tokens - start, [], sample=True))
            sampled[request.request_id] = SampledToken(token, -0.25 - 0.01 * step, [(token, -0.25), (0, -3.0)])
        exhausted = [c for c in live.values() if len(c.outputs) >= len(c.script) and not (first and c.chunked)]
        for case in exhausted:   # the script ran out: the "client" aborts it
            _end(processor, case, FinishReason.ABORT)
            del live[case.request_id]
        rows = [r for r in rows if r.request.request_id in live]
        if not rows:
            first = False
            continue
        before = {r.request.request_id: (list(r.request.output_token_ids), r.request.first_token_time)
                  for r in rows}
        outputs = processor.process(StepPlan(rows, [], sum(r.num_new_tokens for r in rows)), StepResult(sampled))
        _check_step(outputs, rows, sampled, before, live)
        for output in outputs:
            case = live[output.request_id]
            case.outputs.append(output)
            if output.finish_reason is not None or output.finished:
                _end(processor, case, output.finish_reason)
                del live[case.request_id]
        first = False
        step += 1


def _check_step(outputs: list[RequestOutput], rows: list[ScheduledRequest], sampled: dict[str, SampledToken],
                before: dict[str, tuple[list[int], float | None]], live: dict[str, _Case]) -> None:
    counts = Counter(o.request_id for o in outputs)
    for request_id, n in counts.items():
        if request_id not in live:
            raise broken(SEAM, ONE_FINISH, f"process returned an output for {request_id!r}, which is not in the "
                                           "step (it finished or was never added)")
        if request_id not in sampled:
            raise broken(SEAM, ONE_OUTPUT, f"process returned an output for {request_id!r}, whose row sampled "
                                           "no token (a prefill chunk)")
        if n > 1:
            raise broken(SEAM, ONE_OUTPUT, f"process returned {n} outputs for {request_id!r} in one step")
    for row in rows:
        request = row.request
        request_id = request.request_id
        token = sampled.get(request_id)
        if token is None:
            if request.output_token_ids != before[request_id][0]:
                raise broken(SEAM, BOOKKEEPING, f"{request_id!r} got output tokens from a row that sampled none")
            continue
        if not counts[request_id]:
            raise broken(SEAM, ONE_OUTPUT, f"process returned no output for {request_id!r}, which sampled "
                                           f"token {token.token_id}")
        if request.output_token_ids != [*before[request_id][0], token.token_id]:
            raise broken(SEAM, BOOKKEEPING, f"after process, {request_id!r} has output tokens "
                                            f"{request.output_token_ids}, expected the earlier ones plus the "
                                            f"sampled {token.token_id}")
        if request.status is not RequestStatus.RUNNING or request.finish_reason is not None \
                or request.finished_time is not None:
            raise broken(SEAM, BOOKKEEPING, f"process changed {request_id!r}'s status, finish_reason or "
                                            "finished_time; the engine core alone ends requests")
        if before[request_id][1] is None and request.first_token_time is None and not before[request_id][0]:
            raise broken(SEAM, BOOKKEEPING, f"{request_id!r} got its first token but no first_token_time")
    for output in outputs:
        token = sampled[output.request_id]
        if output.new_token_ids != [token.token_id]:
            raise broken(SEAM, ONE_OUTPUT, f"the output of {output.request_id!r} carries tokens "
                                           f"{output.new_token_ids}, but the step sampled [{token.token_id}]")
        if output.finished != (output.finish_reason is not None) or output.finish_reason not in (
                None, FinishReason.STOP, FinishReason.LENGTH):
            raise broken(SEAM, REPORTS, f"an output of {output.request_id!r} has finished={output.finished} and "
                                        f"finish_reason={output.finish_reason!r}")
        if live[output.request_id].request.sampling_params.logprobs is not None and \
                [t.token_id for t in output.new_logprobs] != [token.token_id]:
            raise broken(SEAM, LOGPROBS, f"{output.request_id!r} asked for logprobs, its output carries "
                                         f"{output.new_logprobs!r} for sampled token {token.token_id}")


def _end(processor: TokenProcessor, case: _Case, reason: FinishReason | None) -> None:
    """What the engine core does when a request ends: set its status, then ``forget``."""
    request = case.request
    request.status, request.finish_reason = RequestStatus.FINISHED, reason or FinishReason.ABORT
    processor.forget(request.request_id)


def _verify(kit: _Kit, cases: list[_Case]) -> None:
    """Each case finished where it must, with the reason and the text it must have."""
    for case in cases:
        finishes = [i for i, o in enumerate(case.outputs, start=1) if o.finish_reason is not None]
        where = f"case {case.name!r} ({case.request_id})"
        if len(finishes) > 1:
            raise broken(SEAM, ONE_FINISH, f"{where}: outputs {finishes} each report a finish")
        got = finishes[0] if finishes else None
        reason = case.outputs[got - 1].finish_reason if got else None
        if (got, reason) != (case.finish_at, case.reason):
            said = f"finished at output {got} with {reason.value!r}" if got and reason else "never finished"
            want = (f"output {case.finish_at} with {case.reason.value!r}" if case.finish_at and case.reason
                    else f"no finish within its {len(case.script)} tokens")
            raise broken(SEAM, case.invariant, f"{where}: {said}; expected {want}")
        deltas = [o.new_text for o in case.outputs]
        if case.text is not None and case.joined not in (case.text, *case.texts):
            raise broken(SEAM, case.invariant, f"{where}: the deltas join to {case.joined!r}, expected {case.text!r}")
        if case.text is not None and REPLACEMENT_CHAR not in case.text and any(REPLACEMENT_CHAR in d for d in deltas):
            raise broken(SEAM, DETOKENIZE, f"{where}: a delta ends inside a multi-byte character: {deltas!r}")


def _run(kit: _Kit, cases: list[_Case], *, max_model_len: int = MAX_MODEL_LEN) -> None:
    _drive(kit, kit.processor(max_model_len), cases)
    _verify(kit, cases)


# --- the cases ---------------------------------------------------------------------------------

def _eos_cases(kit: _Kit) -> list[_Case]:
    words, tail = kit.encode(" The quick brown fox"), kit.encode(" jumps")
    script = [*words, kit.eos, *tail]
    return [
        _Case("eos", kit.request("eos", SamplingParams(max_tokens=32)), script, EOS,
              len(words) + 1, FinishReason.STOP, kit.decode(words)),
        _Case("eos with ignore_eos",
              kit.request("eos-ignored", SamplingParams(max_tokens=len(script), ignore_eos=True)),
              script, EOS, len(script), FinishReason.LENGTH, kit.decode(script)),
    ]


def _stop_id_cases(kit: _Kit) -> list[_Case]:
    script = kit.encode(_SENTENCE)
    stop = script[8]   # ' f' of ' fox'
    k = script.index(stop) + 1
    params = SamplingParams(max_tokens=len(script), stop_token_ids=[stop], ignore_eos=True)
    return [_Case("stop_token_ids", kit.request("stop-id", params), script, STOP_IDS, k, FinishReason.STOP,
                  kit.decode(script[:k - 1]), texts=(kit.decode(script[:k]),))]


def _stop_string_cases(kit: _Kit) -> list[_Case]:
    script = kit.encode(_SENTENCE)
    cases = []
    for stop in ("azy d", "fox jumps over"):
        assert not any(stop in kit.decode([t]) for t in script), "the kit's stop string must span tokens"
        for include in (False, True):
            k, text = kit.stop_cut(script, stop, include=include)
            params = SamplingParams(max_tokens=len(script), stop=[stop], include_stop_str_in_output=include)
            cases.append(_Case(f"stop string {stop!r} across tokens{', included' if include else ''}",
                               kit.request(f"stop-{len(cases)}", params), script, STOP_STRINGS,
                               k, FinishReason.STOP, text))
    # a stop string whose beginning shows up ("lazy") but never completes: the text comes out whole
    params = SamplingParams(max_tokens=len(script), stop=["lazy cat"])
    cases.append(_Case("stop string 'lazy cat' that never completes", kit.request("stop-none", params), script,
                       STOP_STRINGS, len(script), FinishReason.LENGTH, kit.decode(script)))
    return cases


def _min_tokens_cases(kit: _Kit) -> list[_Case]:
    head, middle, tail = kit.encode(" The quick"), kit.encode(" brown fox"), kit.encode(" jumps")
    script = [*head, kit.eos, *middle, kit.eos, *tail]
    first_eos, second_eos = len(head) + 1, len(head) + 1 + len(middle) + 1
    min_tokens = first_eos + 2
    foxes = kit.encode(_TWO_FOXES)
    fox_min = 4   # after the first "fox", well before the second
    k, text = kit.stop_cut(foxes, "fox", include=False, after=fox_min - 1)
    assert kit.stop_cut(foxes, "fox", include=False)[0] < fox_min, "the first 'fox' must complete before min_tokens"
    return [
        _Case("eos before min_tokens", kit.request("min-eos", SamplingParams(max_tokens=32, min_tokens=min_tokens)),
              script, MIN_TOKENS, second_eos, FinishReason.STOP, kit.decode(script[:second_eos])),
        _Case("stop string before min_tokens",
              kit.request("min-stop", SamplingParams(max_tokens=len(foxes), min_tokens=fox_min, stop=["fox"])),
              foxes, MIN_TOKENS, k, FinishReason.STOP, text),
    ]


def _max_tokens_cases(kit: _Kit) -> list[_Case]:
    script = kit.encode(_SENTENCE)
    return [
        _Case("max_tokens=5", kit.request("max-5", SamplingParams(max_tokens=5)), script, MAX_TOKENS,
              5, FinishReason.LENGTH, kit.decode(script[:5])),
        _Case("max_tokens=1", kit.request("max-1", SamplingParams(max_tokens=1)), script, MAX_TOKENS,
              1, FinishReason.LENGTH, kit.decode(script[:1])),
    ]


def _max_model_len_cases(kit: _Kit) -> list[_Case]:
    script = kit.encode(_SENTENCE)
    prompt = (kit.encode(_SENTENCE) * 3)[:MAX_MODEL_LEN - 3]
    return [_Case(f"prompt of {len(prompt)} tokens, max_model_len={MAX_MODEL_LEN}",
                  kit.request("model-len", SamplingParams(max_tokens=32), prompt=prompt), script,
                  MAX_MODEL_LEN_INV, 3, FinishReason.LENGTH, kit.decode(script[:3]))]


def _detokenize_cases(kit: _Kit) -> list[_Case]:
    script = kit.encode(_MULTIBYTE)
    assert any(len(kit.encode(ch)) > 1 for ch in "🦀漢∑"), "the kit's characters must span tokens"
    emoji_first = kit.encode("🦀 ok")
    return [
        _Case("multi-byte characters over byte-level tokens",
              kit.request("bytes", SamplingParams(max_tokens=len(script))),
              script, DETOKENIZE, len(script), FinishReason.LENGTH, kit.decode(script)),
        _Case("an emoji as the first output", kit.request("emoji", SamplingParams(max_tokens=len(emoji_first))),
              emoji_first, DETOKENIZE, len(emoji_first), FinishReason.LENGTH, kit.decode(emoji_first)),
    ]


def _logprob_cases(kit: _Kit) -> list[_Case]:
    script = kit.encode(" The quick")
    return [_Case("logprobs=2", kit.request("logprobs", SamplingParams(max_tokens=len(script), logprobs=2)),
                  script, LOGPROBS, len(script), FinishReason.LENGTH, kit.decode(script))]


# --- the checks --------------------------------------------------------------------------------

def _check(cases: Callable[[_Kit], list[_Case]]) -> Callable[[_Kit], None]:
    def run(kit: _Kit) -> None:
        _run(kit, cases(kit))
    return run


def _batched(kit: _Kit) -> None:
    """Every case at once (one chunked prefill among them), each as if alone."""
    cases = [*_eos_cases(kit), *_stop_id_cases(kit), *_stop_string_cases(kit), *_min_tokens_cases(kit),
             *_max_tokens_cases(kit), *_max_model_len_cases(kit), *_detokenize_cases(kit), *_logprob_cases(kit)]
    cases[0].chunked = True
    try:
        _run(kit, cases)
    except ConformanceError as exc:
        raise broken(SEAM, BATCH, f"with every case in one batch, {exc.invariant!r} broke: {exc.detail}") from exc


def _forget(kit: _Kit) -> None:
    """State left by a request (held-back stop-string text, half a character) must not leak into
    a new request with the same id."""
    processor = kit.processor()
    lazy = kit.encode(" over the lazy")
    half_crab = kit.encode("🦀")[:2]
    old = [_Case("held back stop-string text", kit.request("fg", SamplingParams(max_tokens=32, stop=["lazy cat"])),
                 lazy, FORGET),
           _Case("half a character", kit.request("fg2", SamplingParams(max_tokens=32)), half_crab, FORGET)]
    _drive(kit, processor, old)   # the scripts run out: both are aborted and forgotten
    fresh = kit.encode(" ok then")
    new = [_Case(f"a new request reusing the id of {case.name!r}",
                 kit.request(case.request_id, SamplingParams(max_tokens=len(fresh))), fresh, FORGET,
                 len(fresh), FinishReason.LENGTH, kit.decode(fresh)) for case in old]
    _drive(kit, processor, new)
    _verify(kit, new)
    _no_growth(kit, processor)


#: Requests the leak check runs before measuring, and between its two measurements.
_WARM_UP, _MEASURED = 50, 200
#: Growth of the processor's memory over the measured requests that counts as a leak.
_LEAK_BYTES = 64 << 10


def _no_growth(kit: _Kit, processor: TokenProcessor) -> None:
    """Requests added, run and forgotten leave nothing behind: memory does not grow with them."""
    import gc
    import tracemalloc

    script = kit.encode(" The quick 🦀 fox")
    params = SamplingParams(max_tokens=len(script), stop=["lazy cat"])

    def run(first: int, count: int) -> None:
        for i in range(first, first + count, 10):
            _drive(kit, processor, [_Case("leak", kit.request(f"leak{j}", params), script[:4], FORGET)
                                    for j in range(i, i + 10)])

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        run(0, _WARM_UP)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run(_WARM_UP, _MEASURED)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        if started:
            tracemalloc.stop()
    if grown > _LEAK_BYTES:
        raise broken(SEAM, FORGET, f"memory grew by {grown >> 10} KiB over {_MEASURED} requests that were each "
                                   "added, run and forgotten: forget leaves state behind")


def _continuation(kit: _Kit) -> None:
    """Half a request on one processor, the rest on another that replays the first half."""
    script = kit.encode(" crab 🦀 jumps over the lazy dog")
    crab = kit.encode(" crab")
    split = len(crab) + 2   # inside the emoji's bytes
    assert kit.decode(script[:split]).endswith(REPLACEMENT_CHAR), "the kit must split inside a character"
    stop = "🦀 jumps"      # starts before the split, completes after it
    params = SamplingParams(max_tokens=len(script), stop=[stop])
    k, text = kit.stop_cut(script, stop, include=False)
    assert k > split, "the kit's stop string must complete after the split"
    first = _Case("the first holder", kit.request("ct", params), script[:split], CONTINUATION)
    _drive(kit, kit.processor(), [first])
    rest = _Case("the continuation", kit.request("ct", params, outputs=script[:split]), script[split:],
                 CONTINUATION, k - split, FinishReason.STOP)
    _drive(kit, kit.processor(), [rest])
    _verify(kit, [rest])
    if first.joined + rest.joined != text:
        raise broken(SEAM, CONTINUATION, f"the first holder's deltas {first.joined!r} and the continuation's "
                                         f"{rest.joined!r} join to {first.joined + rest.joined!r}, expected {text!r} "
                                         "(split inside a character and a stop string)")
    if rest.outputs and rest.outputs[0].num_output_tokens not in (0, split + 1):
        raise broken(SEAM, CONTINUATION, f"the continuation's first output counts {rest.outputs[0].num_output_tokens} "
                                         f"output tokens; {split} came before it")


#: The token processor kit, in the order it runs.
TOKEN_PROCESSOR_CHECKS: Final = (
    Check("eos", EOS, _check(_eos_cases)),
    Check("stop_token_ids", STOP_IDS, _check(_stop_id_cases)),
    Check("stop_strings", STOP_STRINGS, _check(_stop_string_cases)),
    Check("min_tokens", MIN_TOKENS, _check(_min_tokens_cases)),
    Check("max_tokens", MAX_TOKENS, _check(_max_tokens_cases)),
    Check("max_model_len", MAX_MODEL_LEN_INV, _check(_max_model_len_cases)),
    Check("detokenize", DETOKENIZE, _check(_detokenize_cases)),
    Check("logprobs", LOGPROBS, _check(_logprob_cases)),
    Check("batched", BATCH, _batched),
    Check("forget", FORGET, _forget),
    Check("continuation", CONTINUATION, _continuation),
)
