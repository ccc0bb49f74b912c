"""Read a GGUF file: its shape (parsed by the architecture plugin of its ``general.architecture``),
float32 weights under Hugging Face names, and its metadata.

Tensors of every type gguf-py dequantizes (:func:`supported_tensor_types`: F32, F16, BF16,
Q4_0-Q8_0, the K-quants Q2_K-Q6_K, IQ quants...) are dequantized at load and renamed to Hugging
Face names (a file holding any other type is refused before any is dequantized); with
``keep_quantized`` the matrices the model multiplies by (projections, experts, the embedding / head)
that are Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K stay in their blocks as
:class:`~fd_kernels.quantized.BlockQuantized` (other types, such as Q2_K or IQ4_NL, are float32
either way; a MoE router always is).
Tensor names follow llama.cpp (``blk.N.attn_q.weight``...), as its ``convert_hf_to_gguf.py`` writes
them: a layer's experts merged into one 3-D tensor per projection (``ffn_gate_exps``...), split here
into one matrix per expert; Gemma 3's ``ffn_norm`` is the norm before its MLP; Phi-3's fused
``attn_qkv`` and ``ffn_up`` (gate and up) are split by the plugin's ``prepare_weights``, as a Hugging
Face checkpoint's are. For the architectures whose converter class derives from llama.cpp's
``LlamaModel`` (:data:`PERMUTED_ARCHITECTURES`) the converter stores ``attn_q``/``attn_k`` rows
permuted for interleaved (GPT-J style) RoPE; they are permuted back here so the weights match
Hugging Face's ``rotate_half`` layout, which is what the model implements (the other files keep
Hugging Face's order).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fd_core.contracts.architecture import ArchitectureConfigError
from fd_core.errors import ModelLoadError
from fd_core.model.architectures import ArchitecturePlugins
from fd_core.model.gguf_file import GgufTensor, read_gguf
from fd_kernels.quantized import GGUF_BLOCK_TYPES, BlockQuantized, from_gguf_blocks

if TYPE_CHECKING:

    from fd_core.contracts.architecture import ModelShape

#: The types ``keep_quantized`` keeps in their blocks.
KEPT_TENSOR_TYPES: Final = tuple(GGUF_BLOCK_TYPES)

_GLOBAL_NAMES: Final = {
    "rope_freqs.weight": "model.rope_freqs.weight",   # llama.cpp's per-frequency RoPE factors
    "rope_factors_long.weight": "model.rope_factors_long.weight",     # Phi-3's longrope factors
    "rope_factors_short.weight": "model.rope_factors_short.weight",
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: A block tensor's llama.cpp part (``blk.N.<part>.weight``) -> its Hugging Face module under
#: ``model.layers.N.``; ``{expert}`` marks a layer's experts merged into one 3-D tensor.
_BLOCK_NAMES: Final = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",   # Phi-3's fused q/k/v
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",   # Gemma 3's norms of the sublayers' outputs
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",   # the MoE router
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
#: GGUF architecture -> the parts whose Hugging Face module differs in its files.
_ARCHITECTURE_BLOCK_NAMES: Final = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},   # the norm before the MLP
    "phi3": {"ffn_up": "mlp.gate_up_proj"},                # gate and up, fused
}
#: Block tensors whose Hugging Face name does not end in ``.weight`` / ``.bias`` as llama.cpp's does.
_BLOCK_TENSORS: Final = {"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"}   # ERNIE's score correction
#: GGUF architectures whose q/k rows llama.cpp's converter permuted for interleaved RoPE (its
#: ``LlamaModel`` and the classes derived from it).
PERMUTED_ARCHITECTURES: Final = frozenset({"llama", "granite", "smollm3"})
_BLOCK_TENSOR: Final = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str | Path, *, keep_quantized: bool = False, plugins: ArchitecturePlugins | None = None,
              ) -> tuple[ModelShape, dict[str, np.ndarray | BlockQuantized], dict[str, Any]]:
    """Shape (parsed by the architecture plugin of ``plugins``, default every installed one, that
    serves its ``general.architecture``), float32 weights (Hugging Face names, as the plugin's
    ``prepare_weights`` lays them out) and all metadata values of a GGUF file.

    The metadata dict maps GGUF keys (``tokenizer.ggml.tokens``...) to Python values; the
    tokenizer is built from it. With ``keep_quantized``, matrices (2-D tensors, and each expert of a
    3-D one) of a type in :data:`KEPT_TENSOR_TYPES` are returned as :class:`BlockQuantized` (the
    rest, and MoE routers, as float32).
    """
    path = Path(path)
    try:
        reader = read_gguf(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    metadata = reader.metadata
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
    parts = _BLOCK_NAMES | _ARCHITECTURE_BLOCK_NAMES.get(architecture, {})
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(path, tensor.name, parts)
        keep = (keep_quantized and len(tensor.shape) > 1 and tensor.tensor_type.name in KEPT_TENSOR_TYPES
                and not name.endswith(".mlp.gate.weight"))   # the router is read in float32
        if "{expert}" in name:
            experts = _kept_experts(tensor) if keep else _dequantize(tensor)
            weights |= {name.format(expert=e): weight for e, weight in enumerate(experts)}
            continue
        weight = _kept(tensor) if keep else _dequantize(tensor)
        weights[name] = _unpermute(name, weight, arch) if permuted else weight
    return arch, plugin.prepare_weights(arch, weights), metadata


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


def _hf_name(path: Path, name: str, parts: Mapping[str, str]) -> str:
    """The Hugging Face name of llama.cpp tensor ``name`` (``parts``: the file's block parts)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_TENSOR.fullmatch(name)
    if match is not None:
        layer, part, kind = match.groups()
        if f"{part}.{kind}" in _BLOCK_TENSORS:
            return f"model.layers.{layer}.{_BLOCK_TENSORS[f'{part}.{kind}']}"
        if part in parts:
            return f"model.layers.{layer}.{parts[part]}.{kind}"
    raise ModelLoadError(f"{path}: tensor {name!r} is not part of a model this loader knows")


def _dequantize(tensor: GgufTensor) -> np.ndarray:
    """Float32 array in numpy (row-major) order, i.e. the GGUF ``ne`` shape reversed."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(
        tuple(int(n) for n in reversed(tensor.shape))
    )


def _kept(tensor: GgufTensor) -> BlockQuantized:
    cols, rows = (int(n) for n in tensor.shape)
    return from_gguf_blocks(tensor.tensor_type.name, np.asarray(tensor.data), (rows, cols))


def _kept_experts(tensor: GgufTensor) -> list[BlockQuantized]:
    """Each expert's matrix of a merged-experts (3-D) tensor, in its blocks."""
    cols, rows, experts = (int(n) for n in tensor.shape)
    return [from_gguf_blocks(tensor.tensor_type.name, data, (rows, cols))
            for data in np.asarray(tensor.data).reshape(experts, -1)]


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
