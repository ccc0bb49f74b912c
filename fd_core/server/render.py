"""Render engine outputs as OpenAI response bodies and stream chunks (completions and chat).

A :class:`Renderer` belongs to one HTTP response. Choices are numbered like the engine requests
of :mod:`fd_core.server.prepare` (``prompt_index * n + choice``). ``usage.prompt_tokens``
counts each prompt once (as OpenAI does with ``n`` > 1); ``completion_tokens`` sums every
choice's output tokens.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fd_core.engine.results import CompletionResult
    from fd_core.outputs import RequestOutput, SampledToken
    from fd_core.request import FinishReason
    from fd_core.server.prepare import Prompt
    from fd_core.server.replies import ReplyShape


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Renderer(ABC):
    """Builds one response's JSON; ``logprobs`` says whether choices carry log-probabilities."""

    def __init__(self, *, response_id: str, model: str, tokenizer: Any, prompts: list[Prompt], n: int,
                 logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.n = n
        self.logprobs = logprobs
        self.created = int(time.time())
        self.num_choices = len(prompts) * n
        self.prompt_tokens = sum(len(p.token_ids) for p in prompts)

    def index_of(self, request_id: str) -> int:
        return int(request_id.rsplit("-", 1)[1])

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @abstractmethod
    def start_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any output (chat: the assistant role; completions: the echoed prompt)."""

    @abstractmethod
    def delta_chunks(self, output: RequestOutput, usage_so_far: dict[str, int] | None) -> list[dict[str, Any]]:
        """The chunks for one engine delta (its own, after any it brings on: an echoed prompt)."""

    @abstractmethod
    def body(self, results: list[CompletionResult]) -> dict[str, Any]:
        """The non-streaming response, ``results`` in choice order."""

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self._chunk_head(), "choices": [], "usage": usage(self.prompt_tokens, completion_tokens)}

    @abstractmethod
    def _chunk_head(self) -> dict[str, Any]:
        """``id``, ``object``, ``created`` and ``model`` of a chunk."""


class CompletionRenderer(Renderer):
    """``text_completion`` objects; logprobs in the legacy shape (tokens, token_logprobs, top_logprobs, text_offset).

    With ``echo`` a choice's text starts with its prompt, and with logprobs too its logprobs start
    with the prompt's (``null`` for the first prompt token, which has none). A stream sends each
    choice's echoed prompt as a chunk of its own: before any output, or with logprobs together with
    the prompt's, which come with the choice's first output.
    """

    def __init__(self, *, echo: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo = echo
        self._offsets = [len(self._echo_text(i)) for i in range(self.num_choices)]  # stream text_offset per choice

    def _echo_text(self, index: int) -> str:
        if not self.echo:
            return ""
        prompt = self.prompt_of(index)
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _chunk_head(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "text_completion", "created": self.created, "model": self.model}

    def start_chunks(self) -> list[dict[str, Any]]:
        if not self.echo or self.logprobs:   # with logprobs the echo waits for the prompt's (delta_chunks)
            return []
        return [self._echo_chunk(i, None) for i in range(self.num_choices)]

    def _echo_chunk(self, index: int, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {**self._chunk_head(), "choices": [{"index": index, "text": self._echo_text(index), "logprobs": logprobs,
                                                   "finish_reason": None}]}

    def delta_chunks(self, output: RequestOutput, usage_so_far: dict[str, int] | None) -> list[dict[str, Any]]:
        index = self.index_of(output.request_id)
        chunks = []
        if self.echo and self.logprobs and output.prompt_logprobs is not None:
            chunks.append(self._echo_chunk(index, self._prompt_logprobs(index, output.prompt_logprobs)))
        logprobs = None
        if self.logprobs:
            logprobs = self._logprobs(output.new_logprobs, self._offsets[index])
            self._offsets[index] += sum(len(t) for t in logprobs["tokens"])
        reason = output.finish_reason.value if output.finished and output.finish_reason is not None else None
        chunk = {**self._chunk_head(), "choices": [{"index": index, "text": output.new_text, "logprobs": logprobs,
                                                    "finish_reason": reason}]}
        if usage_so_far is not None:
            chunk["usage"] = usage_so_far
        return [*chunks, chunk]

    def body(self, results: list[CompletionResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            echo = self._echo_text(index)
            logprobs = None
            if self.logprobs:
                logprobs = self._logprobs(result.logprobs, len(echo))
                if self.echo:
                    assert result.prompt_logprobs is not None, "asked for, they come with the first output"
                    prompt = self._prompt_logprobs(index, result.prompt_logprobs)
                    logprobs = {key: prompt[key] + logprobs[key] for key in prompt}
            reason = result.finish_reason.value if result.finish_reason is not None else None
            choices.append({"index": index, "text": echo + result.text, "logprobs": logprobs, "finish_reason": reason})
        return {**self._chunk_head(), "choices": choices,
                "usage": usage(self.prompt_tokens, sum(len(r.token_ids) for r in results))}

    def _prompt_logprobs(self, index: int, logprobs: list[SampledToken]) -> dict[str, Any]:
        """The legacy logprobs of choice ``index``'s prompt: its first token has none."""
        token_ids = self.prompt_of(index).token_ids
        assert len(logprobs) == len(token_ids) - 1, "one prompt logprob per prompt token from the second on"
        return self._legacy(token_ids, [None, *logprobs], 0)

    def _logprobs(self, tokens: list[SampledToken], offset: int) -> dict[str, Any]:
        return self._legacy([t.token_id for t in tokens], tokens, offset)

    def _legacy(self, token_ids: list[int], logprobs: list[SampledToken | None], offset: int) -> dict[str, Any]:
        """``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (from ``offset``) of
        ``token_ids``, each with its logprobs (None: ``null``)."""
        texts = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [None if t is None else t.logprob for t in logprobs],
                "top_logprobs": [None if t is None else {self.token_text(i): lp for i, lp in t.top_logprobs or ()}
                                 for t in logprobs],
                "text_offset": offsets}


class ChatRenderer(Renderer):
    """``chat.completion`` / ``chat.completion.chunk`` objects; logprobs as ``{"content": [...]}``.

    ``shape`` turns each choice's text into a message (reasoning, tool calls: :mod:`fd_core.server.replies`);
    a choice that made calls and stopped has ``finish_reason`` ``tool_calls``.
    """

    def __init__(self, *, shape: ReplyShape | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from fd_core.server.replies import ReplyShape

        self.shape = shape or ReplyShape()
        self._streams = [self.shape.stream() for _ in range(self.num_choices)]

    def _chunk_head(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}

    def start_chunks(self) -> list[dict[str, Any]]:
        return [{**self._chunk_head(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]}
                for i in range(self.num_choices)]

    def delta_chunks(self, output: RequestOutput, usage_so_far: dict[str, int] | None) -> list[dict[str, Any]]:
        index = self.index_of(output.request_id)
        stream = self._streams[index]
        delta = stream.feed(output.new_text) if output.new_text else {}
        if output.finished:
            for key, value in stream.finish().items():
                delta[key] = delta[key] + value if key in delta else value
        elif not delta:
            delta = {"content": ""}
        reason = _finish_reason(output.finish_reason, stream.calls) if output.finished else None
        logprobs = self._logprobs(output.new_logprobs) if self.logprobs else None
        chunk = {**self._chunk_head(), "choices": [{"index": index, "delta": delta,
                                                    "logprobs": logprobs, "finish_reason": reason}]}
        if usage_so_far is not None:
            chunk["usage"] = usage_so_far
        return [chunk]

    def body(self, results: list[CompletionResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            message, has_calls = self.shape.message(result.text)
            choices.append({"index": index, "message": {"role": "assistant", **message},
                            "logprobs": self._logprobs(result.logprobs) if self.logprobs else None,
                            "finish_reason": _finish_reason(result.finish_reason, has_calls)})
        return {"id": self.response_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(self.prompt_tokens, sum(len(r.token_ids) for r in results))}

    def _logprobs(self, tokens: list[SampledToken]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or ()]} for t in tokens],
                "refusal": None}


def _finish_reason(reason: FinishReason | None, calls: int | bool) -> str | None:
    """OpenAI's ``finish_reason``: ``tool_calls`` for a reply that stopped after making calls."""
    if reason is None:
        return None
    return "tool_calls" if calls and reason.value == "stop" else reason.value
