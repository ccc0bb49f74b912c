"""Requests as the engine sees them: sampling parameters, status and token bookkeeping.

The one rule the whole engine follows (after vLLM v1): there are no prefill or decode phases.
A request has ``num_tokens`` tokens (prompt + outputs so far) of which ``num_computed_tokens``
already have K/V in the cache; each step the resource manager schedules some of the rest.
"""

from __future__ import annotations

import enum
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from fd_core.outputs import SampledToken


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"        # queued, holds no KV blocks
    RUNNING = "running"        # holds KV blocks, scheduled each step
    PREEMPTED = "preempted"    # blocks taken back; waits to be recomputed
    FINISHED = "finished"      # done (stop, length, abort or error); holds nothing


class FinishReason(str, enum.Enum):
    """Why a request finished (OpenAI ``finish_reason`` values plus ours)."""

    STOP = "stop"        # eos, stop token id or stop string
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # client went away or abort() was called
    ERROR = "error"      # the engine could not serve it


#: Smallest temperature that samples; below it sampling is greedy (see SamplingParams.greedy).
MIN_TEMPERATURE: Final = 1e-5
#: Most stop strings one request may carry (OpenAI allows 4). Each is checked after every token.
MAX_STOP_STRINGS: Final = 32
#: Longest stop string, in characters.
MAX_STOP_STRING_CHARS: Final = 256
#: Most output tokens the ``n`` choices of one prompt may ask for together (``n * max_tokens``):
#: 128 choices of a 2048-token context fit.
MAX_CHOICE_TOKENS: Final = 2**18
#: Range of ``Request.priority`` that the front doors (the OpenAI server, ``LLM``, ``AsyncLLM``)
#: accept; lower runs first under a priority hook, 0 is the default (as in vLLM).
MIN_PRIORITY: Final = -1000
MAX_PRIORITY: Final = 1000
#: Kinds of constraint a request may carry (see :class:`GuidedDecoding`).
GUIDED_KINDS: Final = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: Longest constraint text, in characters: compiling one is work for the engine's CPU.
MAX_GUIDED_SPEC_CHARS: Final = 128 * 1024
#: Longest reasoning tag a constraint waits for (``GuidedDecoding.reasoning_start`` / ``reasoning_end``),
#: in characters: the engine looks for it in every output token's bytes.
MAX_REASONING_TAG_CHARS: Final = 64
#: Most ``logit_bias`` entries per request (OpenAI allows 300).
MAX_LOGIT_BIAS_ENTRIES: Final = 1024
#: ``logit_bias`` values lie in ``[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]`` (OpenAI's range).
LOGIT_BIAS_LIMIT: Final = 100.0


def check_priority(value: object) -> int:
    """``value`` as an int if it is a valid ``Request.priority``; ``ValueError`` naming ``priority`` otherwise.

    Any integer type is taken (numpy's too); ``bool`` is not, since ``True`` as a priority is a bug.
    """
    try:
        if isinstance(value, bool):
            raise TypeError("bool")
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"priority: must be an integer, got {value!r}") from None
    if not MIN_PRIORITY <= number <= MAX_PRIORITY:
        raise ValueError(f"priority: must be between {MIN_PRIORITY} and {MAX_PRIORITY} (lower runs first), "
                         f"got {number}")
    return number


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """A constraint on the text a request may generate, applied token by token as a mask.

    ``kind`` is one of :data:`GUIDED_KINDS`; ``spec`` is, by kind: ``json`` a JSON schema (JSON
    text), ``json_object`` empty (any JSON object), ``regex`` a regular expression the whole
    output matches, ``choice`` a JSON list of strings (the output is one of them), ``grammar`` an
    EBNF grammar (GBNF, as llama.cpp writes it), ``structural_tag`` a structural tag (JSON text,
    the backend's format). The guided-decoding backend compiles it; one that does not compile is
    refused with the request.

    A reasoning model's reply reasons before it answers; the constraint is on the answer.
    ``reasoning_end`` (e.g. ``"</think>"``): the reply starts inside its reasoning, and the
    constraint applies from the first token after the output's text first holds this tag (no mask
    before; a reply that never closes its reasoning is never constrained). With ``reasoning_start``
    (e.g. ``"<think>"``) as well, the reply reasons only if its text begins with that tag; a reply
    that begins otherwise is constrained from its first token. The engine finds the tags in the
    bytes of the output tokens, however the tokenizer splits them (``fd_core.runner.answer_start``).
    """

    kind: str
    spec: str = ""
    reasoning_end: str | None = None     # the constraint starts after this text; None: from the first token
    reasoning_start: str | None = None   # with reasoning_end: the reply reasons only if it begins with this

    def problem(self) -> str | None:
        """What is wrong with it before compiling (kind, size, reasoning tags), or None."""
        if self.kind not in GUIDED_KINDS:
            return f"kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}"
        if len(self.spec) > MAX_GUIDED_SPEC_CHARS:
            return f"the constraint must be at most {MAX_GUIDED_SPEC_CHARS} characters, got {len(self.spec)}"
        if self.reasoning_start is not None and self.reasoning_end is None:
            return "reasoning_start needs reasoning_end (the tag after which the constraint applies)"
        for name, tag in (("reasoning_start", self.reasoning_start), ("reasoning_end", self.reasoning_end)):
            if tag is not None and not 0 < len(tag) <= MAX_REASONING_TAG_CHARS:
                return f"{name} must be 1 to {MAX_REASONING_TAG_CHARS} characters, got {len(tag)}"
        return None


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated by :meth:`validate`."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0       # 0 (or below MIN_TEMPERATURE) means greedy
    top_k: int = 0                 # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None    # top-n logprobs per sampled token; None: off
    n: int = 1
    guided: GuidedDecoding | None = None   # a constraint on the output (guided decoding); None: free
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    prompt_logprobs: int | None = None   # top-n logprobs per prompt position (from the second on); None: off
    speculate: bool = True   # False: never verify proposed tokens for it (speculative decoding, when configured)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        checks = (
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens"),
            (0 <= self.temperature < float("inf"), "temperature", "must be finite and >= 0"),
            (self.top_k >= -1, "top_k", "must be -1, 0 or positive"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs", "must be in [0, 20]"),
            (self.n >= 1, "n", "must be >= 1"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
        )
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}: {rule}, got {getattr(self, name)!r}")
        # Sizes: what one request makes the engine hold and scan, bounded so that one request cannot
        # stall the engine for everyone; errors name the limit without echoing the values
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings per request, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop: each stop string must be at most {MAX_STOP_STRING_CHARS} characters, "
                             f"got one of {longest}")
        if self.guided is not None and (problem := self.guided.problem()) is not None:
            raise ValueError(f"guided: {problem}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        if any(not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT for bias in self.logit_bias.values()):
            raise ValueError(f"logit_bias: each bias must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        if self.n * self.max_tokens > MAX_CHOICE_TOKENS:
            raise ValueError(f"max_tokens: n x max_tokens must be at most {MAX_CHOICE_TOKENS} tokens, got "
                             f"{self.n} x {self.max_tokens} = {self.n * self.max_tokens}; lower max_tokens or n")

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler must change this row's logits before picking (penalties, a bias,
        a constraint): such a row leaves the all-greedy fast path."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.guided is not None)

    @property
    def speculable(self) -> bool:
        """Whether the runner can verify proposed tokens for it: asked for (``speculate``), and no
        penalty, bias or seed, whose outputs would depend on the tokens accepted before in the same
        step (penalties) or on how many draws a step takes (a seed). A constraint is verified where
        the engine's guided decoding can (``Constraints.can_verify``)."""
        return (self.speculate and self.seed is None and not self.logit_bias and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)

    @property
    def greedy(self) -> bool:
        """Temperatures below :data:`MIN_TEMPERATURE` act as 0: dividing float32 logits by them
        overflows to inf, and every row would pick token 0."""
        return self.temperature < MIN_TEMPERATURE


@dataclass(slots=True, eq=False)
class Request:
    """One generation request and its running state.

    ``output_token_ids`` grows by one per decode step; ``num_computed_tokens`` counts tokens
    whose K/V are in the cache (reset to 0 on preemption, since we recompute).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0                      # lower runs first under a priority hook (check_priority)
    prompt: str | None = None              # the text, when the request came as text
    group_id: str | None = None            # shared by the sibling requests of one client call (n > 1)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0             # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Timestamps (time.time()) for per-request metrics; None until the event happens.
    scheduled_time: float | None = None    # first planned into a step (not updated after a preemption)
    admitted_time: float | None = None     # latest start of running: updated on every (re)admission
    first_token_time: float | None = None
    finished_time: float | None = None
    # Logprobs of prompt positions 1, 2, ... computed so far (``sampling_params.prompt_logprobs``),
    # entry i for prompt token i + 1; the engine core hands them to the first output, then drops them.
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    # Tokens a proposer guessed follow the known ones (speculative decoding), set by the engine core
    # for one step: a resource manager may plan them after the known tokens, the runner verifies them.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prompt logprobs are still to be computed and delivered: asked for
        (``sampling_params.prompt_logprobs``) and no output token yet. They go out with the first
        output token, so a request past it (preempted later, or a continuation, whose client has
        them) needs none. Until then it computes every prompt position: no prefix-cache hits."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def call_id(self) -> str:
        """The client call this request belongs to: ``group_id`` (shared by the ``n`` choices of
        one call), else its own id. Fair sharing gives calls, not requests, their turns."""
        return self.group_id if self.group_id is not None else self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus the proposed ones of this step (``spec_token_ids``): how far a resource
        manager that plans proposals may plan the request."""
        return self.num_tokens + len(self.spec_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + outputs + proposed tokens, without building the full list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        known = self.num_tokens
        if stop > known:   # reaches into this step's proposals
            head = self.token_slice(start, known) if start < known else []
            return head + self.spec_token_ids[max(start - known, 0):stop - known]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:  # keeps prompts out of logs
        return (f"Request(id={self.request_id!r}, status={self.status.value}, "
                f"prompt_len={self.num_prompt_tokens}, outputs={len(self.output_token_ids)}, "
                f"computed={self.num_computed_tokens})")
