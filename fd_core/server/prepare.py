"""Turn a validated OpenAI request body into engine requests: prompt ids, sampling params, limits.

Everything a request can get wrong is checked here, before anything reaches the engine, and
raised as :class:`RequestError` naming the field (the engine validates again; its rejections
name the field the same way). Choice ``i`` of prompt ``p`` becomes the engine request
``{response_id}-{p * n + i}``; with a ``seed`` and ``n`` > 1, choice ``i`` uses ``seed + i``
so the choices differ but the response stays reproducible. All of one HTTP request's engine
requests share ``group_id`` (the response id), which the scheduler uses to give them a fair share,
and the body's ``priority`` (validated by the body model).

A prompt text too long to fit ``max_model_len`` whatever its tokens (see
:attr:`Limits.max_prompt_bytes`) is refused before it is tokenised: tokenising holds the GIL,
and an 8 MiB prompt would take seconds to be refused anyway.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from fd_core.errors import RequestError
from fd_core.request import GuidedDecoding, Request, SamplingParams

if TYPE_CHECKING:
    from fd_core.contracts.reasoning_parser import ReplyReasoning
    from fd_core.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

#: Most engine requests (prompts x n) one HTTP request may create.
MAX_CHOICES: Final = 256

#: JSON values a body may hold besides its token ids (its other fields and their items).
_OTHER_VALUES: Final = 1024

#: How many UTF-8 bytes of text may normalise into one byte: Unicode normalisation (NFC, NFKC)
#: shrinks text at most threefold (fullwidth "Ａ" or a Hangul jamo triple composing to one syllable).
_NORMALISATION_SLACK: Final = 3


@dataclass(frozen=True, slots=True)
class Limits:
    """What the engine announced in READY."""

    max_model_len: int      # most tokens (prompt + output) of one request
    vocab_size: int         # token ids must be below this
    kv_tokens: int          # KV cache capacity in tokens (num_blocks * block_size)
    max_prompt_bytes: int   # a prompt text longer than this (UTF-8) cannot fit max_model_len

    @property
    def max_body_values(self) -> int:
        """The most JSON values a servable body holds: :data:`MAX_CHOICES` prompts of token ids, each
        shorter than ``max_model_len``, ``stop_token_ids`` within the vocabulary, and the other fields."""
        return MAX_CHOICES * self.max_model_len + self.vocab_size + _OTHER_VALUES

    def values_bound(self) -> str:
        """Why a body cannot hold more than :attr:`max_body_values` values (for the 413)."""
        return (f"no request to this model uses more ({MAX_CHOICES} prompts of fewer than max_model_len "
                f"({self.max_model_len}) token ids, stop_token_ids within the vocabulary ({self.vocab_size}))")

    @classmethod
    def from_info(cls, info: dict[str, Any], tokenizer: Any) -> Limits:
        """The limits of the engine's READY ``info`` and the front end's ``tokenizer`` (scans the vocabulary)."""
        # Each token stands for at most its longest text (+1: a SentencePiece "▁x" decodes without
        # the space it stands for), so max_model_len tokens cover at most that many bytes.
        longest = max(len(tokenizer.decode([i], skip_special_tokens=False).encode())
                      for i in range(tokenizer.vocab_size))
        return cls(info["max_model_len"], info["vocab_size"], info["num_blocks"] * info["block_size"],
                   info["max_model_len"] * (longest + 1) * _NORMALISATION_SLACK)


@dataclass(slots=True)
class Prompt:
    """One prompt of a request: its token ids and, when it came as text, the text (for ``echo``)."""

    token_ids: list[int]
    text: str | None

    def __repr__(self) -> str:  # keeps prompts out of logs
        return f"Prompt(tokens={len(self.token_ids)})"


def completion_prompts(body: CompletionRequest, tokenizer: Any, limits: Limits) -> list[Prompt]:
    """The prompts of a /v1/completions body (text, token ids, or a list of either)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise RequestError("prompt", "prompt must not be empty")
    return [_encode(item, tokenizer, limits, "prompt" if len(items) == 1 else f"prompt[{i}]")
            if isinstance(item, str) else Prompt(list(item), None) for i, item in enumerate(items)]


def chat_prompt(body: ChatCompletionRequest, tokenizer: Any, limits: Limits, *, content_as_text: bool) -> Prompt:
    """Render the messages with the model's chat template (RequestError on ``messages``);
    ``content_as_text``: special-token spellings in the messages stay text (``Tokenizer.encode_chat``)."""
    messages = [m.for_template() for m in body.messages]
    variables = body.template_variables()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **variables)
    _check_size(text, limits, "messages")
    return Prompt(tokenizer.encode_chat(messages, text, content_as_text=content_as_text,
                                        add_generation_prompt=body.add_generation_prompt, **variables), text)


def _encode(text: str, tokenizer: Any, limits: Limits, field: str) -> Prompt:
    _check_size(text, limits, field)
    return Prompt(tokenizer.encode(text), text)


def _check_size(text: str, limits: Limits, field: str) -> None:
    size = len(text.encode())
    if size > limits.max_prompt_bytes:
        raise RequestError(field, (
            f"{field} is {size} bytes of text, more than any prompt of at most max_model_len "
            f"({limits.max_model_len}) tokens can hold ({limits.max_prompt_bytes} bytes); shorten it"))


def build_requests(body: _SamplingFields, prompts: list[Prompt], *, max_tokens: int | None,
                   max_tokens_field: str, logprobs: int | None, logprobs_field: str, limits: Limits,
                   eos_token_ids: tuple[int, ...], response_id: str,
                   prompt_logprobs: int | None = None, reasoning: ReplyReasoning | None = None) -> list[Request]:
    """One engine request per (prompt, choice), in choice-index order. Raises RequestError.

    ``prompt_logprobs`` (top-n, the body's ``logprobs_field``) asks for the prompt's logprobs too.
    ``reasoning``: the reply reasons first (the reasoning parser's ``reply_reasoning``), so the body's
    constraint applies to the answer after it."""
    if len(prompts) * body.n > MAX_CHOICES:
        raise RequestError("n", f"{len(prompts)} prompts x n={body.n} = {len(prompts) * body.n} choices; "
                           f"at most {MAX_CHOICES} per request")
    constraint = body.constraint()
    renames = {"max_tokens": max_tokens_field, "logprobs": logprobs_field, "prompt_logprobs": logprobs_field,
               "guided": constraint[0] if constraint else "guided"}
    guided = constraint[1] if constraint else None
    if guided is not None and reasoning is not None:
        guided = dataclasses.replace(guided, reasoning_end=reasoning.end, reasoning_start=reasoning.start)
    placeholder = max(1, body.min_tokens) if max_tokens is None else max_tokens  # replaced per prompt below
    base = _validated(_sampling_params(body, max_tokens=placeholder, logprobs=logprobs,
                                       prompt_logprobs=prompt_logprobs, guided=guided), renames)
    requests = []
    for p_index, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{p_index}]"
        n_prompt = len(prompt.token_ids)
        _check_prompt(prompt, field, limits)
        wanted = max_tokens if max_tokens is not None else min(limits.max_model_len, limits.kv_tokens) - n_prompt
        if wanted < max(1, base.min_tokens):
            raise RequestError(field, f"{field} has {n_prompt} tokens, which leaves room for only {wanted} output "
                               f"tokens (min_tokens is {base.min_tokens}, the KV cache holds {limits.kv_tokens})")
        if n_prompt + wanted > limits.max_model_len:
            raise RequestError(max_tokens_field, (
                f"{field} ({n_prompt} tokens) + {max_tokens_field} ({wanted}) = {n_prompt + wanted} exceeds "
                f"max_model_len ({limits.max_model_len}); set {max_tokens_field} to at most "
                f"{limits.max_model_len - n_prompt}"))
        prompt_params = base if max_tokens is not None else _validated(
            dataclasses.replace(base, max_tokens=wanted), renames)  # n x the room left may be too many
        for choice in range(body.n):
            seed = None if body.seed is None else body.seed + choice
            params = dataclasses.replace(prompt_params, seed=seed, stop=list(base.stop),
                                         stop_token_ids=list(base.stop_token_ids))
            requests.append(Request(request_id=f"{response_id}-{p_index * body.n + choice}",
                                    prompt_token_ids=prompt.token_ids, sampling_params=params,
                                    eos_token_ids=eos_token_ids, prompt=prompt.text, group_id=response_id,
                                    priority=body.priority))
    return requests


def _check_prompt(prompt: Prompt, field: str, limits: Limits) -> None:
    n_prompt = len(prompt.token_ids)
    if n_prompt == 0:
        raise RequestError(field, f"{field} is empty (0 tokens)")
    if n_prompt >= limits.max_model_len:
        raise RequestError(field, (
            f"{field} has {n_prompt} tokens, but max_model_len is {limits.max_model_len} (prompt + output); "
            f"the prompt must be at most {limits.max_model_len - 1} tokens"))
    bad = next((t for t in prompt.token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(field, f"token id {bad} in {field} is outside the vocabulary (0..{limits.vocab_size - 1})")


def _sampling_params(body: _SamplingFields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                     guided: GuidedDecoding | None) -> SamplingParams:
    """The parameters of ``body`` (``max_tokens`` is replaced per prompt when it was not given)."""
    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=pick(body.temperature, 1.0),
        top_k=pick(body.top_k, 0), top_p=pick(body.top_p, 1.0), min_p=pick(body.min_p, 0.0),
        repetition_penalty=pick(body.repetition_penalty, 1.0), presence_penalty=pick(body.presence_penalty, 0.0),
        frequency_penalty=pick(body.frequency_penalty, 0.0), seed=body.seed, stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or ()), include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=body.n, guided=guided,
        logit_bias=body.token_biases(), speculate=body.speculate)


def _validated(params: SamplingParams, renames: dict[str, str]) -> SamplingParams:
    """``params`` once valid; RequestError naming the field as the client wrote it (``renames``)."""
    try:
        params.validate()
    except ValueError as exc:
        name, _, rule = str(exc).partition(": ")
        field = renames.get(name, name)
        raise RequestError(field, f"{field}: {rule}") from exc
    return params
