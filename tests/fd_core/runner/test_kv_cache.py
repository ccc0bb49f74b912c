"""KV cache allocation and its size arithmetic."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import paddle
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


def test_an_int8_cache_has_room_for_a_scale_per_row() -> None:
    """Rows of head_dim codes and a float32 scale (fd_kernels.int8_cache): 16 + 4 bytes a row here."""
    caches = allocate_kv_caches(ARCH, num_blocks=5, block_size=8, dtype="int8")
    assert caches[0].key.shape == [5, 2, 8, 20] and caches[0].key.dtype == paddle.int8
    allocated = sum(c.key.numel().item() + c.value.numel().item() for c in caches)
    assert kv_cache_bytes_per_block(ARCH, 8, "int8") * 5 == allocated
    assert kv_cache_bytes_per_block(ARCH, 8, "int8") * 16 == kv_cache_bytes_per_block(ARCH, 8) * 5


def test_unknown_dtype_rejected() -> None:
    with pytest.raises(ValueError, match="'int4' is not supported"):
        allocate_kv_caches(ARCH, num_blocks=5, block_size=8, dtype="int4")


def _resident_pages(address: int, size: int) -> tuple[int, int]:
    """(resident, all) pages of the whole pages inside ``[address, address + size)``, by mincore(2)."""
    page = os.sysconf("SC_PAGE_SIZE")
    begin, end = -(-address // page) * page, (address + size) // page * page
    pages = (end - begin) // page
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(begin, end - begin, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector.raw), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
def test_a_host_pool_is_zero_and_resident_before_the_first_step() -> None:
    caches = allocate_kv_caches(ARCH, num_blocks=8192, block_size=8, dtype="bfloat16")   # 4 MiB a tensor
    for tensor in (caches[0].key, caches[1].value, caches[2].value):
        resident, pages = _resident_pages(tensor.data_ptr(), tensor.numel().item() * 2)
        assert pages > 500 and resident == pages   # written at allocation: no page faults left for a step
        assert not tensor.cast("float32").abs().max().item()
