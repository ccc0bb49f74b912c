"""Execution of one step plan: lay out the batch, run the model over the paged cache, sample.

The runner owns the model weights and the KV cache tensors; which blocks belong to which
request is decided elsewhere (the resource manager) and arrives in each row's block table.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np
import paddle

from fd_core.contracts.architecture import ModelPrecision
from fd_core.model.kernels import PORTABLE_KERNELS
from fd_core.outputs import ScheduledRequest, StepPlan, StepResult
from fd_core.request import Request, SamplingParams
from fd_core.runner.attention_metadata import build_attention_metadata, order_rows
from fd_core.runner.kv_cache import allocate_kv_caches
from fd_core.runner.memory import MemoryUsage, measure_memory
from fd_core.runner.sampling import token_logprobs

if TYPE_CHECKING:
    from fd_core.contracts.architecture import ModelArchitecture, ModelShape
    from fd_core.model.kernels import KernelSet
    from fd_core.outputs import SampledToken


class TokenSampler(Protocol):
    """What the runner needs from a sampler (``fd_core.runner.sampling.Sampler`` is one)."""

    def sample(self, logits: paddle.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Pick one token per row of float32 ``logits [len(requests), vocab]``."""
        ...

    def verify(self, raw: np.ndarray, request: Request, proposed: list[int]) -> list[SampledToken]:
        """The accepted prefix of ``proposed`` then one more token, from float32 ``raw [len(proposed) + 1, vocab]``."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop any per-request state (seeded generators, penalty counts)."""
        ...


#: Prompt tokens of the warm-up request (then one decode step).
WARMUP_PROMPT_TOKENS: Final = 8


class ModelRunner:
    """Runs :class:`StepPlan` batches of the model ``architecture`` builds on one paddle device.

    ``device`` becomes paddle's current device and ``num_threads`` (default: the CPUs this
    process may run on) its CPU math thread count; both are process-wide, as a runner owns
    its worker process. ``kv_caches`` is public so connectors can read and fill blocks.
    ``kernels`` are the swappable ops chosen from the platform's capabilities (default: portable).
    ``release_weights`` is called once the model is built, before the KV pool is allocated: the
    caller frees the load-time ``weights`` there (the model holds what it needs in the kernels'
    layouts), so that they and the pool are never resident together at start-up.
    """

    def __init__(self, architecture: ModelArchitecture, arch: ModelShape, weights: Mapping[str, Any], *,
                 num_blocks: int,
                 block_size: int, dtype: str = "float32", device: str = "cpu",
                 sampler: TokenSampler, num_threads: int | None = None,
                 kernels: KernelSet = PORTABLE_KERNELS, kv_dtype: str | None = None,
                 linear_weights: str = "float32", linear_inputs: str = "float32",
                 attention_inputs: str = "float32", release_weights: Callable[[], None] | None = None) -> None:
        paddle.set_device(device)
        # Paddle's CPU kernels default to one thread; decode matmuls scale with cores.
        paddle.base.core.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        self.arch = arch
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.sampler = sampler
        self.kernels = kernels
        self.warm_up_seconds: float | None = None   # set by warm_up()
        self.memory: MemoryUsage | None = None       # set by measure_memory(), once start-up ends
        precision = ModelPrecision(dtype, linear_weights, linear_inputs, attention_inputs)
        self.model = architecture.build(arch, weights, kernels=kernels, precision=precision)
        if release_weights is not None:   # before the pool is allocated: the two never sit in memory together
            release_weights()
        self.kv_caches = allocate_kv_caches(arch, num_blocks=num_blocks, block_size=block_size,
                                            dtype=kv_dtype or dtype)

    @paddle.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        """Compute every scheduled row and sample a token for each row with ``sample`` set; for rows
        of requests that ``needs_prompt_logprobs``, the logprobs of the prompt tokens they predict.
        A row that computes proposed tokens (``request.spec_token_ids``) after its known ones has them
        verified instead (:mod:`fd_core.runner.speculative`): ``result.accepted`` and ``result.sampled``.

        Raises ``ValueError`` (before touching the cache) when a row's positions exceed the
        model's context or its block table cannot hold them.
        """
        if plan.is_empty:
            return StepResult.make_empty()
        rows = order_rows(plan.scheduled)
        for row in rows:
            end = row.start + row.num_new_tokens
            if end > self.arch.max_position_embeddings:
                raise ValueError(f"request {row.request.request_id!r} would hold {end} tokens, "
                                 f"beyond max_position_embeddings="
                                 f"{self.arch.max_position_embeddings}")
        prompt_positions = {i: positions for i, row in enumerate(rows) if (positions := _prompt_positions(row))}
        spec_positions = {i: positions for i, row in enumerate(rows) if (positions := _spec_positions(row))}
        assert not prompt_positions.keys() & spec_positions.keys(), "a row predicts prompt and proposed tokens"
        attn = build_attention_metadata(rows, block_size=self.block_size,
                                        num_blocks=self.num_blocks,
                                        num_heads=self.arch.num_attention_heads,
                                        num_kv_heads=self.arch.num_key_value_heads,
                                        dtype=self.dtype, gather_inputs=self.kernels.reads_gather_inputs,
                                        extra_logits={**prompt_positions, **spec_positions})
        token_ids = np.fromiter(
            (t for row in rows
             for t in row.request.token_slice(row.start, row.start + row.num_new_tokens)),
            np.int64, attn.num_tokens)
        logits = self.model.forward(paddle.to_tensor(token_ids), attn, self.kv_caches)
        sampling_rows = [i for i, row in enumerate(rows) if row.sample]   # logits row k is rows[sampling_rows[k]]
        result = StepResult()
        extra = {**prompt_positions, **spec_positions}
        if extra:   # their logits follow the sampling rows' (build_attention_metadata)
            extra_logits = _host_rows(logits[len(sampling_rows):], extra)
            logits = logits[:len(sampling_rows)]
            if prompt_positions:
                result.prompt_logprobs = _prompt_logprobs(extra_logits, rows, prompt_positions)
            if spec_positions:
                last = _host_rows(logits, {k: range(1) for k in range(len(sampling_rows))})
                for k, i in enumerate(sampling_rows):
                    if i in spec_positions:
                        self._verify(rows[i].request, np.concatenate([extra_logits[i], last[k]]), result)
                kept = [k for k, i in enumerate(sampling_rows) if i not in spec_positions]
                sampling_rows = [sampling_rows[k] for k in kept]
                if kept:
                    logits = paddle.gather(logits, paddle.to_tensor(kept))
        requests = [rows[i].request for i in sampling_rows]
        if not requests:
            return result
        sampled = self.sampler.sample(logits, requests)
        for request, token in zip(requests, sampled, strict=True):
            if token.error is None:
                result.sampled[request.request_id] = token
            else:
                result.failed[request.request_id] = token.error
        return result

    def _verify(self, request: Request, logits: np.ndarray, result: StepResult) -> None:
        """Verify the proposed tokens of ``request``'s row from its logits [proposed + 1, V]: the
        accepted ones go to ``result.accepted``, the model's next token to ``result.sampled``; a row its
        constraint leaves no token goes to ``result.failed`` (the core ends the request)."""
        proposed = request.spec_token_ids[:len(logits) - 1]
        *accepted, last = self.sampler.verify(logits, request, proposed)
        if last.error is not None:
            result.failed[request.request_id] = last.error
            return
        result.num_proposed[request.request_id] = len(proposed)
        if accepted:
            result.accepted[request.request_id] = accepted
        result.sampled[request.request_id] = last

    def warm_up(self) -> float:
        """Run a short prefill, then one decode step, through the chosen kernels; returns seconds.

        Called once at start-up, before the engine reports ready, so that a kernel this machine
        cannot run fails (or crashes the process) there rather than on a client's request. It
        writes the first blocks of the pool, which are free at that point (every block is written
        before it is read), and leaves no sampler state behind. If a native kernel kills the
        process, ``faulthandler`` prints the Python stack that called it (the kernel's name).
        """
        begin = time.perf_counter()
        request = Request("fd-warm-up", [t % self.arch.vocab_size for t in range(1, WARMUP_PROMPT_TOKENS + 1)],
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=2))
        blocks = list(range(-(-(WARMUP_PROMPT_TOKENS + 1) // self.block_size)))
        assert len(blocks) <= self.num_blocks, "the KV pool is too small for the warm-up request"
        with _python_stack_on_crash():
            try:
                for start, count in ((0, WARMUP_PROMPT_TOKENS), (WARMUP_PROMPT_TOKENS, 1)):
                    result = self.execute(StepPlan([ScheduledRequest(request, start, count, blocks, sample=True)]))
                    request.num_computed_tokens = start + count
                    request.output_token_ids.append(result.sampled[request.request_id].token_id)
            finally:
                self.release([request.request_id])
        self.warm_up_seconds = time.perf_counter() - begin
        return self.warm_up_seconds

    def measure_memory(self) -> MemoryUsage:
        """This process's resident memory by part now (weights as the kernels hold them, the KV pool,
        the rest), kept in :attr:`memory`; the builder calls it once, when start-up ends."""
        self.memory = measure_memory(self.model, self.kv_caches)
        return self.memory

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished or aborted requests' sampler state (their blocks are freed elsewhere)."""
        for request_id in request_ids:
            self.sampler.forget(request_id)


def _prompt_positions(row: ScheduledRequest) -> range | None:
    """Positions of ``row`` whose logits give prompt logprobs the request still needs, or None.

    Position ``p`` predicts prompt token ``p + 1``, so they run up to the second-to-last prompt
    token, from where ``request.prompt_logprobs`` ends (a recomputed chunk repeats none). A row that
    starts past that end (its earlier positions came from a prefix cache) computes none: the core
    then finds the request's list short and ends it with an error.
    """
    request = row.request
    have = len(request.prompt_logprobs)
    if not request.needs_prompt_logprobs or row.start > have:
        return None
    positions = range(have, min(row.start + row.num_new_tokens, request.num_prompt_tokens - 1))
    return positions or None


def _spec_positions(row: ScheduledRequest) -> range | None:
    """Positions of ``row`` whose logits verify its proposed tokens (``request.spec_token_ids``), or
    None: from its last known token's (which predicts the first proposal) to the one before its last
    proposal's (the row's last position, a sampling row's own logits, predicts the token after it)."""
    known = row.request.num_tokens
    num_proposed = row.start + row.num_new_tokens - known
    if not row.sample or num_proposed <= 0:
        return None
    assert row.start < known, "a row computing proposals computes the last known token too"
    return range(known - 1, known - 1 + num_proposed)


def _host_rows(logits: paddle.Tensor, spans: Mapping[int, range]) -> dict[int, np.ndarray]:
    """Row index -> its float32 logits on the host [len(span), V]; ``logits`` hold the spans' rows
    one after the other, in row order."""
    if logits.dtype != paddle.float32:   # numpy has no bfloat16
        logits = logits.astype("float32")
    host = np.from_dlpack(logits.cpu())   # zero-copy on CPU; read only
    out, offset = {}, 0
    for i, span in sorted(spans.items()):
        out[i] = host[offset:offset + len(span)]
        offset += len(span)
    return out


def _prompt_logprobs(logits: Mapping[int, np.ndarray], rows: list[ScheduledRequest],
                     positions: Mapping[int, range]) -> dict[str, list[SampledToken]]:
    """Request id -> the logprobs of the prompt tokens at ``positions`` + 1 of each row, from each
    row's logits at those positions."""
    out = {}
    for i, span in positions.items():
        request = rows[i].request
        targets = np.asarray(request.prompt_token_ids[span.start + 1:span.stop + 1], np.int64)
        out[request.request_id] = token_logprobs(logits[i], targets,
                                                 [request.sampling_params.prompt_logprobs or 0] * len(span))
    return out


@contextlib.contextmanager
def _python_stack_on_crash() -> Iterator[None]:
    """Turn ``faulthandler`` on for the block (if it was off and stderr is a real file).

    Enabled after Paddle is imported, it runs first on a fatal signal, then chains to Paddle's
    own handler, which prints the C++ stack.
    """
    stderr = sys.__stderr__
    if faulthandler.is_enabled() or stderr is None:
        yield
        return
    try:
        faulthandler.enable(file=stderr)
    except (OSError, ValueError):  # no usable file descriptor (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        faulthandler.disable()
