"""KV cache allocation and its size arithmetic."""

from __future__ import annotations

import pytest

from fd_core.model.arch import LlamaArchConfig
from fd_core.runner.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block

ARCH = LlamaArchConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def test_bytes_per_block_matches_allocation() -> None:
    caches = allocate_kv_caches(ARCH, num_blocks=5, block_size=8)
    assert len(caches) == 3
    assert caches[0].key.shape == [5, 2, 8, 16] and caches[0].value.shape == [5, 2, 8, 16]
    allocated = sum(c.key.numel().item() + c.value.numel().item() for c in caches) * 4
    assert kv_cache_bytes_per_block(ARCH, 8) * 5 == allocated
    assert kv_cache_bytes_per_block(ARCH, 8) == ARCH.kv_bytes_per_token * 8
    assert kv_cache_bytes_per_block(ARCH, 8, "bfloat16") * 2 == kv_cache_bytes_per_block(ARCH, 8)


def test_unknown_dtype_rejected() -> None:
    with pytest.raises(ValueError, match="'int8' is not supported"):
        allocate_kv_caches(ARCH, num_blocks=5, block_size=8, dtype="int8")
