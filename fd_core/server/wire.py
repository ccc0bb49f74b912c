"""The wire format between the front end and the engine process: msgpack-packed lists of primitives.

Every message is one list whose first item is its kind. Front end -> engine (one PUSH/PULL pair)::

    [ADD, request_id, prompt_token_ids, sampling_param_values, eos_token_ids, arrival_time, group_id,
     priority, output_token_ids]                       output tokens already delivered (a continuation)
    [ABORT, [request_id, ...]]
    [STATS, nonce]
    [SHUTDOWN]
    [DRAIN]                                            SIGTERM: serve what was accepted, take no more
                                                       work from other instances

Engine -> front end (a second PUSH/PULL pair)::

    [STARTING, stage]                                  start-up progress, e.g. "loading the model"
    [READY, {"model_name", "max_model_len", "vocab_size", "num_blocks", "block_size",
             "kernels", "warm_up_s"}]
    [FAILED, message]                                  the engine could not start
    [ACK, request_id]                                  add_request accepted it
    [REJECT, request_id, kind, field, message]         kind: "invalid", "queue_full" or "internal"
    [OUTPUTS, [output, ...]]                           one batch of get_results()
    [STATS_REPLY, nonce, {EngineStats as a dict}]

``sampling_param_values`` are :class:`SamplingParams`' fields in declaration order (both ends
run the same code; a constraint is ``[kind, spec, reasoning_end, reasoning_start]``) and ``priority``
is ``Request.priority``. ADD also carries requests between
instances: the ``global`` scheduler stores it in Redis, the splitwise hand-off sends it to the
prefill instance. An output is ``[request_id, new_token_ids, new_text, logprobs, finished,
finish_reason, num_prompt_tokens, num_output_tokens, num_cached_tokens, error, metrics,
prompt_logprobs]`` with ``logprobs`` a list of tokens (:func:`token_values`: ``[token_id, logprob,
[[id, logprob], ...] | None]``), ``metrics`` ``[arrival_time, queue_time, ttft, tpot, e2e]`` or
None, and ``prompt_logprobs`` a list of tokens or None (an instance of an earlier version sends
no ``prompt_logprobs``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import msgpack

from fd_core.outputs import RequestMetrics, RequestOutput, SampledToken
from fd_core.request import FinishReason, GuidedDecoding, Request, SamplingParams

# front end -> engine
ADD: Final = 0
ABORT: Final = 1
STATS: Final = 2
SHUTDOWN: Final = 3
DRAIN: Final = 4
# engine -> front end
READY: Final = 10
FAILED: Final = 11
ACK: Final = 12
REJECT: Final = 13
OUTPUTS: Final = 14
STATS_REPLY: Final = 15
STARTING: Final = 16

#: REJECT kinds.
INVALID: Final = "invalid"
QUEUE_FULL: Final = "queue_full"
INTERNAL: Final = "internal"      # a plugin failed on this request; ``field`` names the plugin

_SAMPLING_FIELDS: Final = tuple(f.name for f in dataclasses.fields(SamplingParams))


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False)


def _sampling_values(params: SamplingParams) -> list[Any]:
    """The fields of ``params`` in declaration order, as msgpack types (a constraint as [kind, spec,
    reasoning_end, reasoning_start], the logit bias as [[token id, bias], ...]: msgpack maps take string
    keys only)."""
    values = {f: getattr(params, f) for f in _SAMPLING_FIELDS}
    guided = params.guided
    values["guided"] = None if guided is None else [guided.kind, guided.spec, guided.reasoning_end,
                                                    guided.reasoning_start]
    values["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]
    return [values[f] for f in _SAMPLING_FIELDS]


def _sampling_params(values: list[Any]) -> SamplingParams:
    fields = dict(zip(_SAMPLING_FIELDS, values, strict=True))
    fields["guided"] = None if fields["guided"] is None else GuidedDecoding(*fields["guided"])
    fields["logit_bias"] = {token: bias for token, bias in fields["logit_bias"]}
    return SamplingParams(**fields)


def encode_request(request: Request) -> list[Any]:
    params = request.sampling_params
    return [ADD, request.request_id, request.prompt_token_ids, _sampling_values(params),
            list(request.eos_token_ids), request.arrival_time, request.group_id, request.priority,
            request.output_token_ids]


def decode_request(message: list[Any]) -> Request:
    (_, request_id, prompt_token_ids, values, eos_token_ids, arrival_time, group_id, priority,
     output_token_ids) = message
    return Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                   sampling_params=_sampling_params(values),
                   eos_token_ids=tuple(eos_token_ids), arrival_time=arrival_time, group_id=group_id,
                   priority=priority, output_token_ids=list(output_token_ids))


def token_values(token: SampledToken) -> list[Any]:
    """A sampled token (its logprobs, no error) as msgpack types: ``[token_id, logprob, top | None]``."""
    top = token.top_logprobs
    return [token.token_id, token.logprob, None if top is None else [list(pair) for pair in top]]


def sampled_token(values: list[Any]) -> SampledToken:
    """The token :func:`token_values` wrote."""
    token_id, logprob, top = values
    return SampledToken(token_id, logprob, None if top is None else [(i, p) for i, p in top])


def encode_output(o: RequestOutput) -> list[Any]:
    m = o.metrics
    metrics = None if m is None else [m.arrival_time, m.queue_time, m.ttft, m.tpot, m.e2e]
    reason = None if o.finish_reason is None else o.finish_reason.value
    prompt_logprobs = None if o.prompt_logprobs is None else [token_values(t) for t in o.prompt_logprobs]
    return [o.request_id, o.new_token_ids, o.new_text, [token_values(t) for t in o.new_logprobs], o.finished, reason,
            o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens, o.error, metrics, prompt_logprobs]


def decode_output(item: list[Any]) -> RequestOutput:
    (request_id, token_ids, text, logprobs, finished, reason, n_prompt, n_output, n_cached, error, metrics,
     *later) = item
    prompt_logprobs = later[0] if later else None
    return RequestOutput(
        request_id=request_id, new_token_ids=token_ids, new_text=text,
        new_logprobs=[sampled_token(t) for t in logprobs],
        finished=finished, finish_reason=None if reason is None else FinishReason(reason),
        num_prompt_tokens=n_prompt, num_output_tokens=n_output, num_cached_tokens=n_cached, error=error,
        metrics=None if metrics is None else RequestMetrics(*metrics),
        prompt_logprobs=None if prompt_logprobs is None else [sampled_token(t) for t in prompt_logprobs])
