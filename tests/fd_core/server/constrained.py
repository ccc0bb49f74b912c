"""The JSON-schema constraint that the fault tests' constrained requests carry, and its undisturbed replies.

:class:`Reading` has no free text (an enum, a fixed-length array of bounded integers, a bool), so
the tiny random model's greedy reply always ends with ``stop`` after about 225 tokens: long enough
to be cut mid-JSON by a fault, never cut by ``max_tokens``. Its first token is ``{``, which no
prompt of these tests starts with unconstrained (:func:`references` checks it), so the instance
that samples a request's first token (a prefill instance) must apply the mask for it to validate.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import pydantic

if TYPE_CHECKING:
    from fd_core.engine.llm import LLM


class Reading(pydantic.BaseModel):
    """What a constrained request asks for."""

    model_config = pydantic.ConfigDict(extra="forbid")
    kind: Literal["tool", "fruit", "toy"]
    values: list[Annotated[int, pydantic.Field(ge=0, le=99)]] = pydantic.Field(min_length=48, max_length=48)
    ok: bool


SCHEMA: Final = Reading.model_json_schema()
#: OpenAI's ``response_format`` of a constrained request (accepted on both endpoints).
RESPONSE_FORMAT: Final = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA, "strict": True}}
#: ``max_tokens`` of a constrained request: room for the whole reply.
MAX_TOKENS: Final = 320


def body(prompt: list[int]) -> dict[str, Any]:
    """The fields of a greedy constrained completion of ``prompt`` (no ``ignore_eos``: the constraint ends it)."""
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "response_format": RESPONSE_FORMAT}


def references(llm: LLM, prompts: list[list[int]]) -> list[str]:
    """The greedy constrained reply to each prompt from ``llm``, an undisturbed offline engine (local
    scheduler). Each validates and ends with ``stop``, and no prompt starts with ``{`` unconstrained."""
    from fd_core.request import FinishReason, GuidedDecoding, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guided=GuidedDecoding("json", json.dumps(SCHEMA)))
    replies = llm.generate(prompts, params)
    free = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    for reply, unconstrained in zip(replies, free, strict=True):
        assert reply.finish_reason is FinishReason.STOP, reply.text
        Reading.model_validate_json(reply.text)
        assert not unconstrained.text.startswith("{"), "the constraint allows this prompt's greedy first token"
    return [reply.text for reply in replies]


def check(text: str, reference: str) -> None:
    """``text`` validates against the schema and is the undisturbed reply."""
    Reading.model_validate_json(text)
    assert text == reference, "a constrained reply differs from the undisturbed one"
