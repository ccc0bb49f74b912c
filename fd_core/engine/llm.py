"""The offline API: ``LLM(...).generate(prompts)`` and ``.chat(messages)`` over one EngineCore.

The engine loop runs in the caller's thread, step by step, until every submitted request has
finished; nothing else is started.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fd_core.engine.results import CompletionResult
from fd_core.errors import RequestError
from fd_core.request import Request, SamplingParams, check_priority

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.engine.core import EngineCore

#: Show a progress bar when a batch has at least this many prompts (and use_tqdm is not False).
PROGRESS_BAR_MIN_PROMPTS = 16

Prompt = str | list[int]
#: What ``model=`` takes: a source (alias, folder, .gguf file) or the keys of the ``[model]`` section.
ModelArg = str | os.PathLike[str] | Mapping[str, Any]


class LLM:
    """Generate offline with the full engine (plugins, paged KV, batching).

    ``LLM("path/or/alias", cache={"num_blocks": 256}, resource_manager={"name": "v0"})``:
    keyword arguments are config sections and override the environment and defaults. ``model``
    is the model's source, or the keys of the ``[model]`` section:
    ``LLM(model={"source": "path", "max_model_len": 256})``.
    """

    def __init__(self, model: ModelArg | None = None, *, config: FdConfig | None = None, **sections: Any) -> None:
        from fd_core.engine.builder import build_engine

        self.config = engine_config(model, config, sections)
        self.engine: EngineCore = build_engine(self.config)
        self.engine.start()
        # closed by close(), by leaving a ``with`` block, or when this object is collected or
        # the interpreter exits, whichever comes first (fd_engine_stopped is told once)
        self._close = weakref.finalize(self, self.engine.close)
        self._ids = itertools.count()

    def close(self) -> None:
        """Tell the plugins the engine stopped and release its connections; later calls do nothing."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: int | Sequence[int] = 0, use_tqdm: bool | None = None) -> list[CompletionResult]:
        """Complete each prompt (text or token ids); results come back in prompt order.

        ``priority`` is ``Request.priority``, one for all prompts or one per prompt: lower runs
        first when a priority hook plugin is installed (it is how requests are scheduled, not
        how tokens are sampled, so it is not a SamplingParams field). Raises RequestError for an
        invalid prompt or priority before any request is queued.
        """
        batch = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = _per_prompt(sampling_params, len(batch))
        priorities = _priorities(priority, len(batch))
        requests = [self._make_request(prompt, sp, prio)
                    for prompt, sp, prio in zip(batch, params, priorities, strict=True)]
        for request in requests:
            self.engine.validate(request)
        results = {r.request_id: CompletionResult(r.request_id, r.prompt, r.prompt_token_ids) for r in requests}
        show_bar = use_tqdm if use_tqdm is not None else len(requests) >= PROGRESS_BAR_MIN_PROMPTS
        self._run(requests, results, show_bar)
        return [results[r.request_id] for r in requests]

    def chat(self, messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             priority: int | Sequence[int] = 0, use_tqdm: bool | None = None) -> list[CompletionResult]:
        """Apply the model's chat template to each conversation, then :meth:`generate`; text that
        spells a special token inside a message stays text (``Tokenizer.encode_chat``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.tokenizer
        prompts = [tokenizer.encode_chat(conv, tokenizer.apply_chat_template(conv, add_generation_prompt=True),
                                         add_generation_prompt=True) for conv in conversations]
        return self.generate(prompts, sampling_params, priority=priority, use_tqdm=use_tqdm)

    def _make_request(self, prompt: Prompt, params: SamplingParams, priority: int) -> Request:
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        return Request(request_id=f"offline-{next(self._ids)}", prompt_token_ids=ids, prompt=text,
                       sampling_params=params, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                       priority=priority)

    def _run(self, requests: list[Request], results: dict[str, CompletionResult], show_bar: bool) -> None:
        from tqdm import tqdm

        pending = len(requests)
        bar = tqdm(total=pending, desc="generate", unit="req", disable=not show_bar)
        queue = iter(requests)
        with bar:
            while pending:
                # keep the scheduler queue topped up without exceeding its size limit
                for request in itertools.islice(queue, max(0, self.engine.scheduler.max_queue_size
                                                           - self.engine.scheduler.num_waiting())):
                    self.engine.add_request(request)
                try:
                    self.engine.step()
                except Exception:  # leave the engine empty for the next generate() call
                    self.engine.fail_in_flight("engine step failed")
                    self.engine.get_results(timeout=0)
                    raise
                for output in self.engine.get_results(timeout=0):
                    result = results.get(output.request_id)
                    if result is None:
                        continue
                    result.add(output)
                    if output.finished:
                        pending -= 1
                        bar.update(1)


def engine_config(model: ModelArg | None, config: FdConfig | None, sections: dict[str, Any]) -> FdConfig:
    """The config of an in-process engine: ``config`` as given, or ``model`` + section overrides
    on top of the environment and defaults (``LLM`` and ``AsyncLLM.start`` take both forms).

    ``model`` is ``model.source`` (a string or path), or a mapping of ``[model]`` keys.
    """
    from fd_core.config import load_config
    from fd_core.errors import ConfigError

    if config is not None:
        if model is not None or sections:
            raise ValueError("pass either config= or model/section overrides, not both")
    else:
        if model is not None:
            keys = dict(model) if isinstance(model, Mapping) else {"source": model}
            if isinstance(keys.get("source"), os.PathLike):
                keys["source"] = os.fspath(keys["source"])
            sections["model"] = {**sections.get("model", {}), **keys}
        config = load_config(**sections)
    if config.parallel.data_parallel_size == "auto":   # what suits one in-process engine: itself
        config = config.with_data_parallel_size(1)
    if config.parallel.data_parallel_size != 1:
        raise ConfigError("parallel.data_parallel_size", f"{config.parallel.data_parallel_size}: an in-process "
                          "engine is one rank; data-parallel ranks run behind fd-serve")
    if config.splitwise.role != "mixed":
        raise ConfigError("splitwise.role", f"{config.splitwise.role!r}: an in-process engine computes whole requests "
                          "(mixed); prefill and decode instances run behind fd-serve")
    return config


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


def _priorities(priority: int | Sequence[int], n: int) -> list[int]:
    """One checked priority per prompt; RequestError on ``priority`` (ValueError for a wrong count)."""
    per_prompt = isinstance(priority, Sequence) and not isinstance(priority, (str, bytes))
    values = list(priority) if per_prompt else [priority] * n  # type: ignore[arg-type]
    if len(values) != n:
        raise ValueError(f"got {len(values)} priorities for {n} prompts")
    try:
        return [check_priority(value) for value in values]
    except ValueError as exc:
        raise RequestError("priority", str(exc)) from exc


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
