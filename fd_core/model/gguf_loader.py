"""Read a GGUF file: its shape (parsed by the architecture plugin of its ``general.architecture``),
float32 weights under Hugging Face names, and its metadata.

Tensors of every type gguf-py dequantizes (:func:`supported_tensor_types`: F32, F16, BF16,
Q4_0-Q8_0, the K-quants Q2_K-Q6_K, IQ quants...) are dequantized at load and renamed to Hugging
Face names (a file holding any other type is refused before any is dequantized); with
``keep_quantized`` the matrices the model multiplies by (projections, the embedding / head) that
are Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K stay in their blocks as
:class:`~fd_kernels.quantized.BlockQuantized` (other types, such as Q2_K or IQ4_NL, are float32
either way).
Tensor names follow llama.cpp (``blk.N.attn_q.weight``...). For ``llama`` files llama.cpp's
converter stores ``attn_q``/``attn_k`` rows permuted for interleaved (GPT-J style) RoPE; they are
permuted back here so the weights match Hugging Face's ``rotate_half`` layout, which is what the
model implements (``qwen2`` / ``qwen3`` files keep Hugging Face's order).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fd_core.contracts.architecture import ArchitectureConfigError
from fd_core.errors import ModelLoadError
from fd_core.model.architectures import ArchitecturePlugins
from fd_kernels.quantized import GGUF_BLOCK_TYPES, BlockQuantized, from_gguf_blocks

if TYPE_CHECKING:
    import gguf

    from fd_core.contracts.architecture import ModelShape

#: The types ``keep_quantized`` keeps in their blocks.
KEPT_TENSOR_TYPES: Final = tuple(GGUF_BLOCK_TYPES)

_GLOBAL_NAMES: Final = {
    "rope_freqs.weight": "model.rope_freqs.weight",   # llama.cpp's per-frequency RoPE factors
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES: Final = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
#: GGUF architectures whose q/k rows llama.cpp's converter permuted for interleaved RoPE.
PERMUTED_ARCHITECTURES: Final = frozenset({"llama"})
_BLOCK_TENSOR: Final = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str | Path, *, keep_quantized: bool = False, plugins: ArchitecturePlugins | None = None,
              ) -> tuple[ModelShape, dict[str, np.ndarray | BlockQuantized], dict[str, Any]]:
    """Shape (parsed by the architecture plugin of ``plugins``, default every installed one, that
    serves its ``general.architecture``), float32 weights (Hugging Face names) and all metadata
    values of a GGUF file.

    The metadata dict maps GGUF keys (``tokenizer.ggml.tokens``...) to Python values; the
    tokenizer is built from it. With ``keep_quantized``, 2-D tensors of a type in
    :data:`KEPT_TENSOR_TYPES` are returned as :class:`BlockQuantized` (the rest as float32).
    """
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    architecture = str(metadata.get("general.architecture"))
    plugin = (plugins or ArchitecturePlugins()).for_gguf(architecture, str(path))
    permuted = architecture in PERMUTED_ARCHITECTURES
    supported = supported_tensor_types()
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not "
                f"supported; supported types: {', '.join(supported)}"
            )
    try:
        arch = plugin.parse_gguf(metadata, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors})
    except ArchitectureConfigError as e:
        raise ModelLoadError(f"{path}: {e} (architecture plugin {plugin.name!r})") from e
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(path, tensor.name)
        keep = keep_quantized and len(tensor.shape) == 2 and tensor.tensor_type.name in KEPT_TENSOR_TYPES
        weight = _kept(tensor) if keep else _dequantize(tensor)
        weights[name] = _unpermute(name, weight, arch) if permuted else weight
    return arch, weights, metadata


@functools.cache
def supported_tensor_types() -> tuple[str, ...]:
    """Names of the GGML tensor types the installed gguf-py dequantizes, in enum order.

    Asked of gguf-py rather than listed here, so a new gguf-py's dequantizers load at once:
    a type is supported when ``gguf.quants.dequantize`` decodes one zero block of it.
    """
    import gguf

    supported = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros(type_size, np.uint8), qtype)
        except NotImplementedError:
            continue
        supported.append(qtype.name)
    return tuple(supported)


def _hf_name(path: Path, name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_TENSOR.fullmatch(name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise ModelLoadError(f"{path}: tensor {name!r} is not part of a model this loader knows")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Float32 array in numpy (row-major) order, i.e. the GGUF ``ne`` shape reversed."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(
        tuple(int(n) for n in reversed(tensor.shape))
    )


def _kept(tensor: gguf.ReaderTensor) -> BlockQuantized:
    cols, rows = (int(n) for n in tensor.shape)
    return from_gguf_blocks(tensor.tensor_type.name, np.asarray(tensor.data), (rows, cols))


def _unpermute(name: str, weight: np.ndarray | BlockQuantized,
               arch: ModelShape) -> np.ndarray | BlockQuantized:
    """Undo llama.cpp's ``permute`` of Q/K rows (per head: interleaved pairs -> two halves)."""
    if ".q_proj." in name:
        heads = arch.num_attention_heads
    elif ".k_proj." in name:
        heads = arch.num_key_value_heads
    else:
        return weight
    # the converter viewed rows as (heads, 2, head_dim/2) and swapped the last two axes
    rows = weight.shape[0]
    order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)
    if isinstance(weight, BlockQuantized):
        return weight.take_rows(order)
    return np.ascontiguousarray(weight[order])
