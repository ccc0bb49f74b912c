"""Build an :class:`EngineCore` from a config: plugins, platform, model, KV pool, runner.

Order matters and is the start-up contract: the whole config and every selected plugin are
validated first (cheap, no device work); then the platform's worker environment is applied,
the kernels are chosen from its declared capabilities (logged once, in one line), the model is
loaded, the KV pool is sized from the platform's memory profile (or ``cache.num_blocks``), the
model is built in the kernels' layouts and the load-time arrays are freed before the pool is
allocated, the runner warms up (a short prefill and a decode step through the chosen kernels),
the resident memory is logged by part, and only then are the seam plugins instantiated; last, a
prefill or decode instance starts its part in hand-offs (binds its connector and publishes itself
in the peer directory).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fd_core.contracts.proposer import ModelRuntime
from fd_core.contracts.resource_manager import KVLimits
from fd_core.errors import ConfigError
from fd_core.host_memory import release_freed_memory
from fd_core.precision import kernel_problems, kv_cache_dtype

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.contracts.architecture import ModelShape
    from fd_core.contracts.platform import Platform
    from fd_core.engine.core import EngineCore
    from fd_core.model.kernels import KernelSet
    from fd_core.model.tokenizer import Tokenizer
    from fd_core.registry import Registry
    from fd_core.runner.constraints import Constraints
    from fd_core.selection import SelectedPlugin

log = logging.getLogger(__name__)

#: Upper bound of the default max_model_len (the model may allow more).
DEFAULT_MAX_MODEL_LEN = 2048
#: Memory kept aside for activations when sizing the KV pool from the profile.
ACTIVATION_RESERVE_BYTES = 512 << 20
#: With ``cache.memory_utilization`` unset, the largest KV pool in host memory (device "cpu"):
#: the profile's 0.3 of RAM, capped by max_num_seqs full-length requests, took ~3 GiB for a
#: 98 MB model, filling a small machine. 512 MiB holds ~11k tokens of SmolLM2-135M.
HOST_DEFAULT_KV_CAP_BYTES = 512 << 20
#: The share of device memory used when ``cache.memory_utilization`` is unset.
DEFAULT_MEMORY_UTILIZATION = 0.3
#: How to grow the pool, for the log line and errors.
GROW_HINT = "grow it with cache.memory, cache.num_blocks or cache.memory_utilization"


@dataclass(frozen=True, slots=True)
class KVPlan:
    """How the KV pool was sized, for logs and ``/metrics``."""

    num_blocks: int
    bytes_per_block: int
    source: str   # "cache.num_blocks" or "profile: ..."


def build_engine(config: FdConfig, registry: Registry | None = None, *,
                 progress: Callable[[str], None] | None = None) -> EngineCore:
    """Validate, load and wire every part; raises ConfigError / PluginError / ModelLoadError.

    ``progress(stage)`` is told each heavy stage before it starts ("loading the model", "warm-up
    ..."), so that a process watching this one can say where start-up failed, even when a
    native kernel kills the process.
    """
    from fd_core.config import config_errors
    from fd_core.engine.core import EngineCore
    from fd_core.model.loader import load_model
    from fd_core.selection import resolve
    from fd_core.splitwise.setup import build_handoff

    report = progress or (lambda stage: None)

    selection = resolve(config, registry, apply_worker_env=True)  # raises every config problem at once
    platform = selection.platform
    assert platform is not None, "resolve() instantiates the selected platform"
    worker_env = platform.worker_env()
    os.environ.update(worker_env)
    process_note = platform.prepare_process()
    report("choosing kernels (the C++ kernels are built on first use, then cached)")
    kernels = choose_kernels(platform, selection.platform_reason, worker_env, process_note)
    problems = kernel_problems(config, kernels)   # a build failure --check could not foresee
    if problems:
        raise config_errors(problems)

    stage = f"loading the model {config.model.source!r}"
    report(stage)
    log.info("%s", stage)
    loaded = load_model(config.model.source, keep_quantized=config.model.quantized_weights == "keep",
                        plugins=selection.architecture_plugins())
    arch = loaded.arch
    max_model_len = _max_model_len(config, arch)
    kv = plan_kv_pool(config, arch, platform, max_model_len=max_model_len,
                      weights_bytes=sum(w.nbytes for w in loaded.weights.values()))
    log.info("KV pool: %d blocks of %d tokens, %d MiB (%s)", kv.num_blocks, config.cache.block_size,
             kv.num_blocks * kv.bytes_per_block >> 20, kv.source)

    from fd_core.runner.model_runner import WARMUP_PROMPT_TOKENS, ModelRunner
    from fd_core.runner.sampling import Sampler

    constraints = build_constraints(selection.plugins.get("guided_decoding"), loaded.tokenizer, arch.vocab_size)

    def release_weights() -> None:   # the model is built: the load-time arrays are garbage now
        loaded.weights.clear()
        gc.collect()
        if release_freed_memory():
            log.info("gave the memory freed after loading back to the system")

    runner = ModelRunner(loaded.architecture, arch, loaded.weights, num_blocks=kv.num_blocks,
                         block_size=config.cache.block_size,
                         dtype=config.model.dtype, kv_dtype=kv_cache_dtype(config), device=platform.device_string(),
                         sampler=Sampler(seed=config.model.seed, constraints=constraints),
                         num_threads=platform.num_threads(),
                         kernels=kernels, linear_weights=config.model.linear_weights,
                         linear_inputs=config.model.linear_inputs,
                         attention_inputs=config.model.attention_inputs, release_weights=release_weights)
    report(f"warm-up forward pass (kernels: {kernels.describe()})")
    warm_up_s = runner.warm_up()
    log.info("warm-up: a %d-token prefill and a decode step took %.2f s", WARMUP_PROMPT_TOKENS, warm_up_s)
    log.info("memory: %s", runner.measure_memory().describe())
    limits = KVLimits(
        num_blocks=kv.num_blocks, block_size=config.cache.block_size,
        max_num_seqs=config.engine.max_num_seqs, max_num_batched_tokens=config.engine.max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=config.engine.enable_chunked_prefill,
        enable_prefix_caching=selection.enable_prefix_caching)
    hooks = selection.registry.hooks
    resource_manager = selection["resource_manager"].create(limits=limits, hooks=hooks)
    scheduler = selection["scheduler"].create(hooks=hooks, max_queue_size=config.server.max_queue_size)
    token_processor = selection["token_processor"].create(
        tokenizer=loaded.tokenizer, max_model_len=max_model_len)
    model_name = config.model.served_name or config.model.source
    handoff = build_handoff(config, selection, scheduler=scheduler, resource_manager=resource_manager,
                            runner=runner, model_name=model_name)
    tracer = None
    if config.plugins.trace_hooks:   # last: every hook implementation is registered by now
        from fd_core.hook_trace import HookTracer

        tracer = HookTracer()
        tracer.install(selection.registry.plugin_manager)
    proposer = selection.plugins.get("proposer")   # speculative decoding; absent when proposer.name is 'none'
    core = EngineCore(scheduler=scheduler, resource_manager=resource_manager, token_processor=token_processor,
                      runner=runner, limits=limits, hooks=hooks, tokenizer=loaded.tokenizer,
                      model_name=model_name, config=config, handoff=handoff, hook_tracer=tracer,
                      constraints=constraints,
                      proposer=None if proposer is None else proposer.create(
                          max_proposed_tokens=config.proposer.num_speculative_tokens, vocab_size=arch.vocab_size,
                          runtime=ModelRuntime(kernels, platform.device_string(), config.model.dtype)))
    handoff.start(core.wake)
    return core


def build_constraints(selected: SelectedPlugin | None, tokenizer: Tokenizer, vocab_size: int) -> Constraints:
    """The engine's guided decoding through the selected backend (None: off, or none installed); a
    backend that cannot run here (its library missing) is logged once, and constrained requests are
    refused with its reason."""
    from fd_core.contracts.guided_decoding import GuidedDecodingUnavailable
    from fd_core.runner.constraints import Constraints

    if selected is None:
        return Constraints(None, vocab_size=vocab_size, unavailable=(
            "no guided-decoding backend is selected (guided_decoding.name = 'none', or none is installed)"))
    try:
        backend = selected.create(vocabulary=tokenizer.vocabulary(vocab_size))
    except GuidedDecodingUnavailable as exc:
        log.warning("guided decoding is off: %s", exc)
        return Constraints(None, vocab_size=vocab_size, unavailable=str(exc))
    log.info("guided decoding: %s", selected.name)
    return Constraints(backend, vocab_size=vocab_size, token_bytes=tokenizer.token_bytes())


def choose_kernels(platform: Platform, platform_reason: str, worker_env: dict[str, str],
                   process_note: str = "") -> KernelSet:
    """The kernels ``platform.capabilities`` allow, announced in one start-up line (with the
    worker environment that was applied and what ``prepare_process`` did)."""
    from fd_core.model.kernels import select_kernels

    kernels = select_kernels(platform.capabilities)
    env = " ".join(f"{key}={value}" for key, value in sorted(worker_env.items())) or "none"
    log.info("platform %s (%s); capabilities: %s; kernels: %s; worker env: %s%s", platform.name, platform_reason,
             " ".join(sorted(platform.capabilities)) or "none", kernels.describe(), env,
             f"; {process_note}" if process_note else "")
    return kernels


def _max_model_len(config: FdConfig, arch: ModelShape) -> int:
    wanted = config.model.max_model_len
    if wanted is None:
        return min(arch.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if wanted > arch.max_position_embeddings:
        raise ConfigError("model.max_model_len", f"{wanted} exceeds the model's context of "
                          f"{arch.max_position_embeddings} tokens")
    return wanted


def _pool_too_small(platform: Platform, utilization: float, ranks: int, budget: int, weights_bytes: int, fits: int,
                    blocks_per_seq: int, max_model_len: int) -> ConfigError:
    """The error of a KV pool that cannot hold one full-length request, naming the knob that
    limited it: the platform's own cap (it answered below the memory profile), else the share."""
    from fd_core.contracts.platform import Platform as PlatformContract

    by_profile = PlatformContract.kv_cache_memory_bytes(platform, utilization=utilization / ranks,
                                                        weights_bytes=weights_bytes,
                                                        activation_reserve_bytes=ACTIVATION_RESERVE_BYTES)
    need = f"{fits} blocks, but one {max_model_len}-token request needs {blocks_per_seq}"
    share = f"{utilization}" + (f" shared by {ranks} data-parallel ranks" if ranks > 1 else "")
    if budget < by_profile:
        return ConfigError("platform.options", (
            f"platform {platform.name!r} allows {budget >> 20} MiB for the KV cache ({need}), less than "
            f"cache.memory_utilization = {share} would give ({by_profile >> 20} MiB): the platform's own "
            f"limit applies; raise it in [platform.options], lower model.max_model_len, or set cache.num_blocks"))
    return ConfigError("cache.memory_utilization", (
        f"{share} leaves {budget >> 20} MiB for the KV cache: {need}; raise it, lower model.max_model_len"
        + (", use fewer ranks (parallel.data_parallel_size)" if ranks > 1 else "") + ", or set cache.num_blocks"))


def _plan_from_memory(memory: int, platform: Platform, per_block: int, blocks_per_seq: int, cap: int,
                      max_model_len: int, ranks: int) -> KVPlan:
    """The pool of ``cache.memory`` bytes, capped at what ``max_num_seqs`` full-length requests use;
    the ``ranks`` data-parallel ranks starting together need one each."""
    blocks = memory // per_block
    if blocks < blocks_per_seq:
        raise ConfigError("cache.memory", (
            f"{memory} bytes hold {blocks} KV blocks of {per_block} bytes, but one {max_model_len}-token "
            f"request needs {blocks_per_seq}; raise it or lower model.max_model_len"))
    free = platform.memory_profile().free_bytes - ACTIVATION_RESERVE_BYTES
    if memory * ranks > free:
        each = f" for each of {ranks} data-parallel ranks" if ranks > 1 else ""
        raise ConfigError("cache.memory", (
            f"{memory >> 20} MiB{each} is more than the {max(0, free) >> 20} MiB free now (after "
            f"{ACTIVATION_RESERVE_BYTES >> 20} MiB kept for activations); lower it"))
    if cap < blocks:
        return KVPlan(cap, per_block, f"cache.memory, capped at {cap} blocks for engine.max_num_seqs")
    return KVPlan(blocks, per_block, "cache.memory")


def plan_kv_pool(config: FdConfig, arch: ModelShape, platform: Platform, *, max_model_len: int,
                 weights_bytes: int) -> KVPlan:
    """Number of KV blocks: ``cache.num_blocks`` if set, else what ``cache.memory`` or the memory
    profile allows.

    The profile-based count is capped at what ``max_num_seqs`` full-length requests could
    ever use, so a large machine does not zero-fill memory it can never need. With
    ``cache.memory_utilization`` unset, a pool in host memory is also capped at
    :data:`HOST_DEFAULT_KV_CAP_BYTES` (never below one full-length request): RAM is shared with
    everything else on the machine, and most deployments of a small model need far less.

    With N data-parallel ranks (``parallel.data_parallel_size``, a number by now) the memory share
    is the whole server's: each rank sizes its pool from ``memory_utilization / N`` (its own
    weights and activation reserve come out of that), so N ranks together stay within the share.
    ``cache.memory`` and ``cache.num_blocks`` are each rank's pool.
    """
    from fd_core.runner.kv_cache import kv_cache_bytes_per_block

    block_size = config.cache.block_size
    per_block = kv_cache_bytes_per_block(arch, block_size, kv_cache_dtype(config))
    blocks_per_seq = -(-max_model_len // block_size)
    ranks = config.parallel.data_parallel_size
    assert isinstance(ranks, int), "resolve data_parallel_size 'auto' before building an engine"
    if config.cache.num_blocks is not None:
        return KVPlan(config.cache.num_blocks, per_block, "cache.num_blocks")
    cap = blocks_per_seq * config.engine.max_num_seqs
    if config.cache.memory is not None:
        return _plan_from_memory(config.cache.memory, platform, per_block, blocks_per_seq, cap, max_model_len, ranks)
    utilization = config.cache.memory_utilization or DEFAULT_MEMORY_UTILIZATION
    budget = platform.kv_cache_memory_bytes(utilization=utilization / ranks, weights_bytes=weights_bytes,
                                            activation_reserve_bytes=ACTIVATION_RESERVE_BYTES)
    fits = budget // per_block
    if fits < blocks_per_seq:
        raise _pool_too_small(platform, utilization, ranks, budget, weights_bytes, fits, blocks_per_seq, max_model_len)
    per_rank = f" (1/{ranks} of the share per data-parallel rank)" if ranks > 1 else ""
    source = f"profile: {budget >> 20} MiB for KV{per_rank}, capped at {cap} blocks for engine.max_num_seqs"
    if config.cache.memory_utilization is None and platform.device_string() == "cpu":
        host_cap = max(blocks_per_seq, HOST_DEFAULT_KV_CAP_BYTES // per_block)
        if host_cap < min(fits, cap):
            cap = host_cap
            source = f"default cap for host memory: {HOST_DEFAULT_KV_CAP_BYTES >> 20} MiB; {GROW_HINT}"
    return KVPlan(min(fits, cap), per_block, source)
