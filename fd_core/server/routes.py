"""The HTTP endpoints: completions, chat completions, models, health and metrics.

A generation request takes a concurrency slot, has its body read (at most
``server.max_body_bytes``, :mod:`.body`), has its JSON values counted and is parsed, validated
and turned into engine requests on a worker thread (:mod:`.prepare`), is queued in the engine
(all its choices or none), then either streams one SSE event per engine delta or collects the
whole answer. A client that goes away aborts its requests: a streaming response is cancelled by
Starlette when the client disconnects, and a non-streaming one is watched with
``request.is_disconnected()`` while it waits. Every wait runs in a
:class:`~fd_core.server.drain.Drain` scope, so that a request still in flight when the shutdown
timeout runs out is answered with 503 in the usual error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from fd_core.engine.results import CompletionResult
from fd_core.errors import EngineDeadError, FdError, RequestError
from fd_core.request import FinishReason
from fd_core.server import sse
from fd_core.server.body import check_values, read_body
from fd_core.server.http_errors import ApiError, bad_request, from_exception, from_validation_errors
from fd_core.server.metrics import CONTENT_TYPE
from fd_core.server.prepare import build_requests, chat_prompt, completion_prompts
from fd_core.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from fd_core.server.render import ChatRenderer, CompletionRenderer, usage
from fd_core.server.replies import AUTO, NONE, REQUIRED, ReplyShape

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from fd_core.outputs import RequestOutput
    from fd_core.request import Request as EngineRequest
    from fd_core.server.drain import Drain
    from fd_core.server.engine_client import RequestStream
    from fd_core.server.prepare import Limits
    from fd_core.server.protocol import StreamOptions, _Body
    from fd_core.server.render import Renderer
    from fd_core.server.state import ServerState

log = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound="_Body")   # a request body with an optional model field

#: How often a non-streaming request checks whether its client is still there, in seconds.
DISCONNECT_POLL_S: Final = 0.5
#: Status logged (never seen by anyone) for a request whose client went away (nginx's convention).
CLIENT_CLOSED_REQUEST: Final = 499


def _state(request: Request) -> ServerState:
    return request.app.state.fd


async def check_api_key(request: Request) -> None:
    """401 unless the bearer token equals ``server.api_key`` (when one is set)."""
    key = _state(request).config.server.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = key.get_secret_value().encode()
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected):
        raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <server.api_key>'",
                       type="authentication_error", code="invalid_api_key")


router = APIRouter()
api = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when the engine serves; 503 while starting, draining or after it died.

    ``degraded`` (still 200: it serves what reaches it) when the scheduler says so, e.g. the
    global scheduler lost its Redis. The body names the instance's ``role`` (``splitwise.role``);
    while it serves, its ``load`` (requests running, waiting, HTTP requests in flight, free KV
    blocks: what a router balances by); once the engine is up, its kernels and warm-up time.
    """
    state = _state(request)
    status, reason = state.status()
    body: dict[str, Any] = {"status": status, "reason": reason, "role": state.config.splitwise.role}
    if status == "ok":
        try:
            stats = await state.client.stats()
        except (FdError, asyncio.TimeoutError):
            stats = {}   # the engine's own state above is what counts then
        degraded = (stats.get("scheduler") or {}).get("degraded_reason")
        if degraded:
            status, reason = "degraded", degraded
            body.update(status=status, reason=reason)
        if stats:
            kv = stats["kv"]
            body["load"] = {"running": kv["num_running"],
                            "waiting": kv["num_waiting"] + stats["num_waiting_in_scheduler"],
                            "in_flight": state.in_flight, "free_blocks": kv["num_free_blocks"],
                            "num_blocks": kv["num_blocks"]}
    info = state.client.info
    if info:
        body["engine"] = {"kernels": info.get("kernels"), "warm_up_s": info.get("warm_up_s")}
    return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    stats = None
    if state.ready:
        try:
            stats = await state.client.stats()
        except (FdError, asyncio.TimeoutError):
            log.warning("no engine stats for /metrics", exc_info=True)
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


@router.post("/tokenize", dependencies=[Depends(check_api_key)])
async def tokenize(request: Request) -> JSONResponse:
    """Token ids of a text or of chat messages as the chat endpoint would render them."""
    return await _tokenizer_reply(request, _tokenize)


@router.post("/detokenize", dependencies=[Depends(check_api_key)])
async def detokenize(request: Request) -> JSONResponse:
    """The text of token ids."""
    return await _tokenizer_reply(request, _detokenize)


async def _tokenizer_reply(request: Request, answer: Callable[[bytes, ServerState], dict[str, Any]]) -> JSONResponse:
    """The JSON ``answer`` gives for the request's body (on a worker thread), once the server serves."""
    state = _state(request)
    state.check_serving()
    raw = await read_body(request, state.config.server.max_body_bytes)
    return JSONResponse(await state.run_blocking(answer, raw, state))


def _tokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    limits = _limits(state)
    body = _parse(raw, TokenizeRequest, state, limits)
    if body.messages is not None:
        chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                     tools=body.tools, chat_template_kwargs=body.chat_template_kwargs)
        tokens = chat_prompt(chat, state.tokenizer, limits,
                             content_as_text=state.config.server.special_tokens_in_messages == "text").token_ids
    else:
        tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        reply["token_strs"] = [state.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    return reply


def _detokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    limits = _limits(state)
    body = _parse(raw, DetokenizeRequest, state, limits)
    bad = next((t for t in body.tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})", "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


@api.get("/models")
async def models(request: Request) -> JSONResponse:
    state = _state(request)
    card: dict[str, Any] = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "fd-engine"}
    if state.limits is not None:  # vLLM's extension, plus what fd-bench needs to draw token ids
        card["max_model_len"] = state.limits.max_model_len
        card["vocab_size"] = state.limits.vocab_size
    return JSONResponse({"object": "list", "data": [card]})


@api.post("/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, _prepare_completion)


@api.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, _prepare_chat)


router.include_router(api)


@dataclass(slots=True)
class _Job:
    """A generation request ready for the engine: its engine requests and how to answer."""

    requests: list[EngineRequest]
    renderer: Renderer
    stream: bool
    options: StreamOptions | None
    constraint_field: str | None = None   # the body field the constraint came in (the engine says "guided")
    echo_only: bool = False               # completions' max_tokens 0 with echo: the one token made is not shown

    def client_error(self, exc: RequestError) -> RequestError:
        """The engine's refusal, naming the body's field where the engine names the constraint."""
        if exc.field != "guided" or self.constraint_field is None:
            return exc
        return RequestError(self.constraint_field, str(exc).replace("guided:", f"{self.constraint_field}:", 1))

    def shown(self, output: RequestOutput) -> RequestOutput:
        """``output`` as the client sees it: with ``echo_only``, without the token generated (the
        engine generates at least one), and a normal end is ``length``, as max_tokens 0 asked."""
        if not self.echo_only:
            return output
        reason = FinishReason.LENGTH if output.finish_reason is FinishReason.STOP else output.finish_reason
        return dataclasses.replace(output, new_token_ids=[], new_text="", new_logprobs=[], num_output_tokens=0,
                                   finish_reason=reason)


def _prepare_completion(raw: bytes, state: ServerState) -> _Job:
    """Parse and prepare a /v1/completions body (on a worker thread)."""
    limits = _limits(state)
    body = _parse(raw, CompletionRequest, state, limits)
    echo_only = body.max_tokens == 0   # vLLM's: the prompt (and with logprobs its logprobs), nothing generated
    if echo_only and not body.echo:
        raise bad_request("max_tokens: must be >= 1, got 0 (0 only with echo: the prompt alone)", "max_tokens")
    if echo_only and body.min_tokens:
        raise bad_request(f"min_tokens: must be 0 with max_tokens 0, got {body.min_tokens}", "min_tokens")
    prompts = completion_prompts(body, state.tokenizer, limits)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = build_requests(body, prompts, max_tokens=1 if echo_only else body.max_tokens,
                              max_tokens_field="max_tokens", logprobs=body.logprobs, logprobs_field="logprobs",
                              prompt_logprobs=body.logprobs if body.echo else None, limits=limits,
                              eos_token_ids=tuple(state.tokenizer.eos_token_ids), response_id=response_id)
    renderer = CompletionRenderer(response_id=response_id, model=state.model_name, tokenizer=state.tokenizer,
                                  prompts=prompts, n=body.n, logprobs=body.logprobs is not None, echo=body.echo)
    return _Job(requests, renderer, body.stream, body.stream_options, _constraint_field(body), echo_only)


def _constraint_field(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    constraint = body.constraint()
    return constraint[0] if constraint else None


def _prepare_chat(raw: bytes, state: ServerState) -> _Job:
    """Parse, template and prepare a /v1/chat/completions body (on a worker thread)."""
    limits = _limits(state)
    body = _parse(raw, ChatCompletionRequest, state, limits)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise bad_request("set max_completion_tokens or max_tokens, not both", "max_tokens")
    field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt = chat_prompt(body, state.tokenizer, limits,
                         content_as_text=state.config.server.special_tokens_in_messages == "text")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # a constraint is on the answer: where the reply may reason first, it waits for the reasoning's end tag
    reasoning = None if state.reasoning_parser is None else state.reasoning_parser.reply_reasoning(prompt.text or "")
    requests = build_requests(body, [prompt], max_tokens=max_tokens, max_tokens_field=field, logprobs=logprobs,
                              logprobs_field="top_logprobs", limits=limits,
                              eos_token_ids=tuple(state.tokenizer.eos_token_ids), response_id=response_id,
                              reasoning=reasoning)
    mode = body.tool_mode()
    if mode == AUTO and state.tool_parser is None:
        raise bad_request("tool_choice: auto needs a tool parser, and this model's chat template matches none of the "
                          "installed ones; name one with tool_parser.name, or send tool_choice required or a "
                          "named function (enforced by a constraint, for any model)", "tool_choice")
    shape = ReplyShape(reasoning_parser=state.reasoning_parser,
                       tool_parser=state.tool_parser if mode == AUTO else None, required_calls=mode == REQUIRED,
                       named_function=None if mode in (None, NONE, AUTO, REQUIRED) else mode,
                       prompt=prompt.text or "")
    renderer = ChatRenderer(response_id=response_id, model=state.model_name, tokenizer=state.tokenizer,
                            prompts=[prompt], n=body.n, logprobs=body.logprobs, shape=shape)
    return _Job(requests, renderer, body.stream, body.stream_options, _constraint_field(body))


def _parse(raw: bytes, model: type[BodyT], state: ServerState, limits: Limits) -> BodyT:
    """The body as ``model``, asking for the served model (404 otherwise); parsed as JSON whatever
    the Content-Type says (curl -d sends a form type), once its values are counted (413 for more
    than any servable request holds)."""
    check_values(raw, limits.max_body_values, limits.values_bound())
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
    if body.model is not None and body.model != state.model_name:
        raise ApiError(404, f"model {body.model!r} not found; this server serves {state.model_name!r}",
                       type="invalid_request_error", param="model", code="model_not_found")
    return body


def _limits(state: ServerState) -> Limits:
    assert state.limits is not None, "check_serving() lets requests through only once the engine is ready"
    return state.limits


async def _generate(request: Request, prepare: Callable[[bytes, ServerState], _Job]) -> Response:
    """Serve one generation request whose body ``prepare`` turns into a job (on a worker thread)."""
    state = _state(request)
    state.check_serving()
    state.admit()
    streaming = False  # once the stream is built, it releases the slot when it ends
    try:
        async with state.drain.scope():
            raw = await read_body(request, state.config.server.max_body_bytes)
            job = await state.run_blocking(prepare, raw, state)
            try:
                outputs = await state.client.add(job.requests)
            except RequestError as exc:
                raise job.client_error(exc) from None
            if job.stream:
                def on_close() -> None:
                    outputs.close()
                    state.release()

                streaming = True
                return _EventStream(_events(outputs, job, state.drain), on_close=on_close)
            try:
                results = await _collect_while_connected(request, outputs, job)
            finally:
                outputs.close()
    finally:
        if not streaming:
            state.release()
    if results is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    failed = next((r for r in results if r.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)), None)
    if failed is not None:
        raise ApiError(500, f"the engine could not complete the request: {failed.error or 'aborted'}",
                       type="server_error")
    return JSONResponse(job.renderer.body(results))


async def _collect_while_connected(request: Request, outputs: RequestStream,
                                   job: _Job) -> list[CompletionResult] | None:
    """Every choice's result, or None when the client went away first."""
    task = asyncio.ensure_future(_collect(outputs, job))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        task.cancel()


async def _collect(outputs: RequestStream, job: _Job) -> list[CompletionResult]:
    results = {r.request_id: CompletionResult(r.request_id, r.prompt, r.prompt_token_ids) for r in job.requests}
    async for output in outputs:
        results[output.request_id].add(job.shown(output))
    return [results[r.request_id] for r in job.requests]


class _EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` exactly once when it ends, however it ends.

    (A generator's ``finally`` is not enough: a client that leaves before the first chunk can
    cancel the response before the generator ever starts.)
    """

    def __init__(self, events: AsyncIterator[bytes], *, on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type=sse.MEDIA_TYPE, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _events(outputs: RequestStream, job: _Job, drain: Drain) -> AsyncIterator[bytes]:
    """The SSE body: start chunks, the chunks of each delta, the usage chunk, ``[DONE]``.

    An error (engine died, request failed, shutdown timeout) becomes an error event before ``[DONE]``.
    Cancellation (client gone) aborts the unfinished requests through ``outputs.close()``.
    """
    renderer, options = job.renderer, job.options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    completion_tokens: dict[str, int] = {}
    try:
        for chunk in renderer.start_chunks():
            yield sse.event(chunk)
        async for engine_output in drain.iterate(outputs):
            output = job.shown(engine_output)
            if output.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                message = f"the engine could not complete the request: {output.error or 'aborted'}"
                yield sse.event(ApiError(500, message, type="server_error").body())
                break
            completion_tokens[output.request_id] = output.num_output_tokens
            so_far = usage(renderer.prompt_tokens, sum(completion_tokens.values())) if continuous else None
            for chunk in renderer.delta_chunks(output, so_far):
                yield sse.event(chunk)
        else:
            if include_usage:
                yield sse.event(renderer.usage_chunk(sum(completion_tokens.values())))
    except (EngineDeadError, ApiError) as exc:
        yield sse.event(from_exception(exc).body())
    finally:
        outputs.close()  # aborts at once on cancellation; _EventStream releases the slot
    yield sse.DONE
