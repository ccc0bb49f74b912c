"""KV cache allocation and its size arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from fd_core.model.arch import LlamaArchConfig
from fd_core.runner.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
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


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="needs Linux with transparent huge pages")
def test_a_host_pool_asks_for_huge_pages_and_stays_zero() -> None:
    caches = allocate_kv_caches(ARCH, num_blocks=8192, block_size=8, dtype="bfloat16")   # 4 MiB a tensor
    for tensor in (caches[0].key, caches[2].value):
        inner = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES   # a whole 2 MiB page inside
        assert "hg" in _vm_flags(inner)
        assert not tensor.cast("float32").abs().max().item()
    small = allocate_kv_caches(ARCH, num_blocks=2, block_size=8)[0].key
    assert not advise_huge_pages(small.data_ptr(), small.numel().item() * 4)   # no 2 MiB page inside it
