"""KV pool sizing from the platform's memory profile, the explicit override and its errors."""

from __future__ import annotations

import pytest

from fd_core.config import load_config
from fd_core.engine.builder import ACTIVATION_RESERVE_BYTES, plan_kv_pool
from fd_core.errors import ConfigError
from fd_core.model.arch import LlamaArchConfig
from fd_core.runner.kv_cache import kv_cache_bytes_per_block
from fd_plugins.platforms.cpu import CpuPlatform

ARCH = LlamaArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=512)


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
    big = LlamaArchConfig("LlamaForCausalLM", vocab_size=512, hidden_size=4096, intermediate_size=128,
                          num_hidden_layers=64, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                          max_position_embeddings=4096)
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
