"""Engine start-up: KV pool sizing, kernel choice and its start-up line, dtype check, warm-up."""

from __future__ import annotations

import logging
import mmap

import pytest

from fd_core.config import load_config
from fd_core.engine.builder import (
    ACTIVATION_RESERVE_BYTES,
    HOST_DEFAULT_KV_CAP_BYTES,
    build_engine,
    choose_kernels,
    plan_kv_pool,
)
from fd_core.errors import ConfigError
from fd_core.model.arch import LlamaArchConfig
from fd_core.model.kernels import PORTABLE_KERNELS
from fd_core.runner.kv_cache import kv_cache_bytes_per_block
from fd_core.runner.memory import array_span, held_arrays
from fd_kernels import native
from fd_plugins.platforms import cpu_features
from fd_plugins.platforms.cpu import CpuPlatform, CpuSettings
from fd_plugins.platforms.cpu_features import ISA_FEATURES, CpuFeatures

ARCH = LlamaArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=512)

#: A shape whose KV blocks are large (64 layers x 32 KV heads of 128): pools sized from memory shares.
LARGE_KV_ARCH = LlamaArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=4096, intermediate_size=128,
                                num_hidden_layers=64, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                                max_position_embeddings=4096)


def test_explicit_num_blocks_wins():
    plan = plan_kv_pool(load_config(cache={"num_blocks": 77}), ARCH, CpuPlatform(), max_model_len=256,
                        weights_bytes=0)
    assert plan.num_blocks == 77 and plan.source == "cache.num_blocks"


def test_profile_budget_is_capped_by_what_max_num_seqs_can_use():
    config = load_config(cache={"memory_utilization": 0.5, "block_size": 16}, engine={"max_num_seqs": 4})
    plan = plan_kv_pool(config, ARCH, CpuPlatform(), max_model_len=256, weights_bytes=0)
    assert plan.num_blocks == 4 * 256 // 16          # tiny model: the cap binds, not memory
    assert plan.bytes_per_block == kv_cache_bytes_per_block(ARCH, 16)


def test_profile_budget_follows_memory_utilization():
    big = LARGE_KV_ARCH
    platform = CpuPlatform()
    small = plan_kv_pool(load_config(cache={"memory_utilization": 0.2}, engine={"max_num_seqs": 512}),
                         big, platform, max_model_len=256, weights_bytes=0)
    large = plan_kv_pool(load_config(cache={"memory_utilization": 0.4}, engine={"max_num_seqs": 512}),
                         big, platform, max_model_len=256, weights_bytes=0)
    budget = platform.kv_cache_memory_bytes(utilization=0.2, weights_bytes=0,
                                            activation_reserve_bytes=ACTIVATION_RESERVE_BYTES)
    assert small.num_blocks == budget // small.bytes_per_block
    assert large.num_blocks > small.num_blocks


def test_too_little_memory_names_the_key():
    huge = LlamaArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=8192, intermediate_size=128,
                           num_hidden_layers=512, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
                           max_position_embeddings=65536)
    with pytest.raises(ConfigError, match=r"^cache\.memory_utilization: .* one 65536-token request needs"):
        plan_kv_pool(load_config(cache={"memory_utilization": 0.01}), huge, CpuPlatform(),
                     max_model_len=65536, weights_bytes=0)


def test_data_parallel_ranks_share_the_memory_utilization():
    """N ranks start together and each sizes its own pool: each takes 1/N of the share, so N pools
    together stay within it; a share too small for the ranks, or a per-rank cache.memory that N
    ranks cannot all have, is an error naming the key and the ranks."""
    big = LARGE_KV_ARCH
    platform = CpuPlatform()
    one = plan_kv_pool(load_config(cache={"memory_utilization": 0.1}, engine={"max_num_seqs": 512}),
                       big, platform, max_model_len=256, weights_bytes=0)
    four = plan_kv_pool(load_config(cache={"memory_utilization": 0.4}, engine={"max_num_seqs": 512},
                                    parallel={"data_parallel_size": 4}), big, platform, max_model_len=256,
                        weights_bytes=0)
    assert four.num_blocks == one.num_blocks and "1/4 of the share per data-parallel rank" in four.source
    with pytest.raises(ConfigError, match=r"^cache\.memory_utilization: 0\.3 shared by 1024 data-parallel ranks "
                                          r"leaves .* use fewer ranks \(parallel\.data_parallel_size\)"):
        plan_kv_pool(load_config(parallel={"data_parallel_size": 1024}), big, platform, max_model_len=256,
                     weights_bytes=0)
    with pytest.raises(ConfigError, match=r"^cache\.memory: 8192 MiB for each of 1024 data-parallel ranks is more "):
        plan_kv_pool(load_config(cache={"memory": "8GiB"}, parallel={"data_parallel_size": 1024}), ARCH, platform,
                     max_model_len=256, weights_bytes=0)


def test_cache_memory_sizes_the_pool_beyond_the_host_default_cap():
    per_block = kv_cache_bytes_per_block(ARCH, 16)
    wanted = HOST_DEFAULT_KV_CAP_BYTES + 1000 * per_block + per_block // 2   # not a whole number of blocks
    config = load_config(cache={"memory": wanted, "block_size": 16},
                         engine={"max_num_seqs": 10_000, "max_num_batched_tokens": 10_000})
    plan = plan_kv_pool(config, ARCH, CpuPlatform(), max_model_len=256, weights_bytes=0)
    assert (plan.num_blocks, plan.source) == (wanted // per_block, "cache.memory")
    capped = plan_kv_pool(load_config(cache={"memory": wanted, "block_size": 16}, engine={"max_num_seqs": 4}),
                          ARCH, CpuPlatform(), max_model_len=256, weights_bytes=0)
    assert capped.num_blocks == 4 * 256 // 16 and "capped" in capped.source


def test_cache_memory_takes_units_and_refuses_a_second_pool_size():
    assert load_config(cache={"memory": "4GiB"}).cache.memory == 4 << 30
    assert load_config(cache={"memory": "512MiB"}).cache.memory == 512 << 20
    with pytest.raises(ConfigError, match=r"^cache: .*cache\.num_blocks and cache\.memory each size the KV pool"):
        load_config(cache={"memory": "1GiB", "num_blocks": 64})
    with pytest.raises(ConfigError, match=r"cache\.memory and cache\.memory_utilization each size"):
        load_config(cache={"memory": "1GiB", "memory_utilization": 0.5})
    with pytest.raises(ConfigError, match=r"^cache\.memory: "):
        load_config(cache={"memory": "lots"})


def test_cache_memory_that_cannot_be_had_names_the_key():
    with pytest.raises(ConfigError, match=r"^cache\.memory: .* one 256-token request needs 16"):
        plan_kv_pool(load_config(cache={"memory": kv_cache_bytes_per_block(ARCH, 16) * 15, "block_size": 16}),
                     ARCH, CpuPlatform(), max_model_len=256, weights_bytes=0)
    with pytest.raises(ConfigError, match=r"^cache\.memory: 1048576 MiB is more than the \d+ MiB free now"):
        plan_kv_pool(load_config(cache={"memory": "1TiB"}), ARCH, CpuPlatform(), max_model_len=256, weights_bytes=0)


@pytest.fixture
def faked_cpu_builds_nothing(monkeypatch):
    """A faked CPU must not build (or load into this process) C++ kernels for an ISA it lacks."""
    def refuse(capabilities):
        raise native.NativeKernelsUnavailable("not built for a faked CPU")

    monkeypatch.setattr(native, "load_native", refuse)


@pytest.mark.parametrize(("present", "chosen"), [({"avx2", "fma"}, "rms_norm=portable"),
                                                 ({"avx2", "fma", "avx512f"}, "rms_norm=fused")])
def test_start_up_line_shows_the_kernels_the_probed_cpu_allows(monkeypatch, caplog, present, chosen,
                                                               faked_cpu_builds_nothing):
    """The ISA probe faked both ways: the capability decides, and the one start-up line says so."""
    features = CpuFeatures("Faked CPU 9000", frozenset(present), "/proc/cpuinfo")
    monkeypatch.setattr(cpu_features, "probe_cpu_features", lambda: features)
    platform = CpuPlatform()
    with caplog.at_level(logging.INFO, logger="fd_core.engine.builder"):
        kernels = choose_kernels(platform, "auto: " + CpuPlatform.detect().reason, platform.worker_env())
    assert kernels.describe().startswith(chosen)
    [line] = [r.getMessage() for r in caplog.records]
    assert "Faked CPU 9000" in line and f"kernels: {chosen}" in line
    lacks = line.partition("; lacks ")[2].split(";")[0].split()
    assert ("avx512f" in lacks) is ("avx512f" not in present)


def test_forced_portable_kernels_on_an_avx512_cpu(monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "probe_cpu_features",
                        lambda: CpuFeatures("Faked Xeon", frozenset(ISA_FEATURES), "/proc/cpuinfo"))
    with caplog.at_level(logging.INFO, logger="fd_core.engine.builder"):
        platform = CpuPlatform(CpuSettings(kernels="portable"))
        kernels = choose_kernels(platform, "explicit", platform.worker_env())
    assert kernels.describe() == PORTABLE_KERNELS.describe()
    assert "capabilities: paged_attention;" in caplog.records[0].getMessage()


def test_config_problems_stop_the_build_before_any_heavy_work_all_at_once(tmp_path):
    config = load_config(model={"source": str(tmp_path / "unused"), "dtype": "bfloat16"})
    stages = []
    with pytest.raises(ConfigError) as info:
        build_engine(config, progress=stages.append)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("model.source: ") and "not found" in lines[0]
    assert lines[1].startswith("model.dtype: 'bfloat16' is not supported by platform 'cpu'")
    assert stages == []  # the model was never loaded


def test_an_unset_memory_utilization_caps_a_host_memory_pool():
    big = LlamaArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=576, intermediate_size=128,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          max_position_embeddings=2048)
    platform = CpuPlatform()
    default = plan_kv_pool(load_config(), big, platform, max_model_len=2048, weights_bytes=0)
    assert default.num_blocks * default.bytes_per_block <= HOST_DEFAULT_KV_CAP_BYTES
    assert default.num_blocks == HOST_DEFAULT_KV_CAP_BYTES // default.bytes_per_block
    assert "cache.memory, cache.num_blocks or cache.memory_utilization" in default.source
    explicit_config = load_config(cache={"memory_utilization": 0.3})
    explicit = plan_kv_pool(explicit_config, big, platform, max_model_len=2048, weights_bytes=0)
    budget = platform.kv_cache_memory_bytes(utilization=0.3, weights_bytes=0,
                                            activation_reserve_bytes=ACTIVATION_RESERVE_BYTES)
    assert explicit.num_blocks == min(budget // explicit.bytes_per_block, 32 * 2048 // explicit_config.cache.block_size)
    assert explicit.num_blocks > default.num_blocks or budget <= HOST_DEFAULT_KV_CAP_BYTES


def test_the_engine_warms_up_before_it_is_returned(make_llm, caplog):
    with caplog.at_level(logging.INFO, logger="fd_core.engine.builder"):
        llm = make_llm()
    messages = [r.getMessage() for r in caplog.records]
    warm_up = next(i for i, m in enumerate(messages) if m.startswith("warm-up: a 8-token prefill and a decode step"))
    kernels = next(i for i, m in enumerate(messages) if "kernels: rms_norm=" in m)
    assert kernels < warm_up
    assert llm.engine.runner.warm_up_seconds > 0
    stats = llm.engine.resource_manager.stats()  # the warm-up took no block from the pool
    assert stats.num_free_blocks == stats.num_blocks


def test_progress_names_each_heavy_stage_before_it_runs(tiny_model_dir, caplog):
    stages = []
    with caplog.at_level(logging.INFO, logger="fd_core.engine.builder"):
        engine = build_engine(load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 64}),
                              progress=stages.append)
    messages = [r.getMessage() for r in caplog.records]
    assert f"loading the model {tiny_model_dir!r}" in messages
    block_size = load_config().cache.block_size
    mib = 64 * kv_cache_bytes_per_block(engine.runner.arch, block_size) >> 20
    assert f"KV pool: 64 blocks of {block_size} tokens, {mib} MiB (cache.num_blocks)" in messages
    assert stages[0].startswith("choosing kernels (the C++ kernels are built on first use")
    assert stages[1] == f"loading the model {tiny_model_dir!r}"
    assert stages[-1].startswith("warm-up forward pass (kernels: rms_norm=")


def test_a_bfloat16_kv_cache_halves_the_pool_and_drains_back_to_free(make_llm):
    from fd_core.request import SamplingParams

    if select_host_kernels().reads_gather_inputs:
        pytest.skip("a bfloat16 KV cache needs the C++ kernels (no compiler here)")
    llm = make_llm(cache={"num_blocks": 64, "dtype": "bfloat16"})
    caches = llm.engine.runner.kv_caches
    assert str(caches[0].key.dtype) == "paddle.bfloat16"
    block_size = load_config().cache.block_size
    assert sum(c.key.numel() * 2 * 2 for c in caches) == 64 * kv_cache_bytes_per_block(
        llm.engine.runner.arch, block_size, "bfloat16")
    outputs = llm.generate([[5, 6, 7, 8] * 10, [9, 10, 11]] * 3,
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [12] * 6
    assert outputs[0].token_ids == outputs[2].token_ids   # same prompt, same tokens
    stats = llm.engine.resource_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("linear_inputs", ["float32", "bfloat16"])
def test_bfloat16_linear_weights_halve_the_weights_and_drain_back_to_free(make_llm, linear_inputs):
    from fd_core.request import SamplingParams

    if select_host_kernels().chosen["linear"].name == "portable":
        pytest.skip("16-bit storage is the C++ linear kernel's (no compiler here)")
    # accuracy: the teacher-forced oracle test
    llm = make_llm(model={"linear_weights": "bfloat16", "linear_inputs": linear_inputs})
    model, arch = llm.engine.runner.model, llm.engine.runner.arch
    qkv_width = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    assert model.layers[0].qkv.bits == 16 and model.lm_head.bits == 16
    assert model.layers[0].qkv.data.numel() == 2 * qkv_width * arch.hidden_size   # 2 bytes a value
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11], list(range(40, 140))] * 2
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert [len(tokens) for tokens in outputs] == [12] * 6
    assert outputs[:3] == outputs[3:]   # reproducible
    stats = llm.engine.resource_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8"])
def test_bfloat16_queries_drain_back_to_free(make_llm, cache_dtype):
    from fd_core.request import SamplingParams

    if select_host_kernels().reads_gather_inputs:
        pytest.skip(f"a {cache_dtype} KV cache needs the C++ kernels (no compiler here)")
    llm = make_llm(cache={"num_blocks": 64, "dtype": cache_dtype}, model={"attention_inputs": "bfloat16"})
    assert llm.engine.runner.model.round_queries
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11], list(range(40, 140))] * 2
    outputs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True), use_tqdm=False)]
    assert [len(tokens) for tokens in outputs] == [12] * 6 and outputs[:3] == outputs[3:]
    stats = llm.engine.resource_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks


def select_host_kernels():
    from fd_core.model.kernels import select_kernels

    return select_kernels(CpuPlatform().capabilities)


def test_start_up_reports_resident_memory_by_part(make_llm, caplog):
    with caplog.at_level(logging.INFO, logger="fd_core.engine.builder"):
        llm = make_llm(cache={"num_blocks": 64})
    memory, runner = llm.engine.stats().memory, llm.engine.runner
    pool = 64 * kv_cache_bytes_per_block(runner.arch, load_config().cache.block_size)
    # the pool is zeroed at start-up: every page resident (its tensors' ends may share a page)
    assert pool <= memory["kv_cache"] <= pool + 4 * runner.arch.num_hidden_layers * mmap.PAGESIZE
    held = held_arrays(runner.model)
    allocated = sum(array_span(array)[1] for array in held)
    assert 0 < memory["weights"] <= allocated + 2 * len(held) * mmap.PAGESIZE
    assert memory["weights"] + memory["kv_cache"] + memory["runtime"] == memory["resident"]
    assert memory["resident"] <= memory["peak_resident"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    assert line.endswith(f"weights {memory['weights'] >> 20:,} MiB as the kernels hold them, KV pool "
                         f"{memory['kv_cache'] >> 20:,} MiB, runtime {memory['runtime'] >> 20:,} MiB")


def test_an_engine_built_with_one_math_thread_runs_its_c_kernels_on_one(monkeypatch, tiny_model_dir):
    """The cpu platform's ``num_threads`` reaches the C++ kernels as well as MKL (they ran on
    every usable CPU whatever it said)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")   # restored afterwards: the build below sets it
    engine = build_engine(load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 16},
                                      platform={"name": "cpu", "options": {"num_threads": 1}}))
    attention = engine.runner.kernels.chosen["attention"]
    if attention.name != "cpp":
        pytest.skip(f"no C++ attention here: {engine.runner.kernels.describe()}")
    captured = dict(zip(attention.fn.__code__.co_freevars, (c.cell_contents for c in attention.fn.__closure__),
                        strict=True))
    assert captured["threads"] == 1
