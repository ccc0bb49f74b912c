"""Write tiny random Llama models (Hugging Face folder and GGUF file) for tests, with numpy only.

:func:`make_tiny_llama` writes a complete Hugging Face folder: ``config.json``,
``model.safetensors`` (float32 or bfloat16, optionally sharded), ``generation_config.json``,
``tokenizer.json`` (a byte-level BPE trained deterministically on fixed text, SmolLM2-style
pre-tokenizer) and ``tokenizer_config.json`` with a ChatML template; :func:`make_tiny_checkpoint`
one of any architecture a plugin serves. :func:`write_tiny_gguf` turns such a folder into a GGUF
file the way llama.cpp's converter would (its keys, names and changes to the tensors), in any
tensor type ``gguf.quants`` can quantize.

Weights are random but not near-uniform (embeddings N(0, 1), Q/K gain 1.5, lm_head gain 3), so
greedy decoding is decisive and layout mistakes change the output.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from fd_core.model.arch import LlamaArchConfig

if TYPE_CHECKING:
    import gguf

#: Special tokens of the tiny tokenizer; ids 0, 1, 2 as in SmolLM2.
TINY_SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A plain ChatML template (no default system prompt).
CHATML_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAINING_TEXT: Final = """\
The quick brown fox jumps over the lazy dog. A serving engine schedules requests, batches them,
and streams tokens back to the client as soon as they are sampled. Each request owns a list of
blocks in the key-value cache; the block table maps logical positions to physical blocks.
Prefill computes the prompt in one pass, decode adds one token per step, and both can share a
batch. Temperature, top-k, top-p and min-p shape the distribution before a token is drawn.
In 2024 there were 366 days; in 2023 there were 365. Numbers like 3.14159 and 2.71828 matter.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Hello, world! How are you today? I am fine, thank you. What time is it? It is 10:45 now.
Paged attention reads keys and values through the block table, one block at a time.
The scheduler admits waiting requests while free blocks remain and preempts when memory runs out.
Les modèles de langage prédisent le mot suivant. Die Katze schläft auf dem Sofa.
你好，世界。今天天气很好。日本語のテキストも少し入れます。 Emoji: 😀 🎉 🚀 👍
Streaming responses use server-sent events; every chunk carries a delta of the generated text.
Metrics report time to first token, time per output token and end-to-end latency percentiles.
"""


def make_tiny_llama(
    folder: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 512,
    tie: bool = False,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] = "float32",
    shards: int = 1,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a random Llama model with a trained tokenizer into ``folder``; return ``folder``.

    ``vocab`` is the embedding size; the tokenizer has at most that many tokens. ``shards > 1``
    splits the weights over ``model-0000i-of-0000n.safetensors`` plus an index file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arch = LlamaArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    config = {
        "architectures": [arch.architecture],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": arch.head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    (folder / "tokenizer.json").write_text(_trained_tokenizer_json(vocab), encoding="utf-8")
    _write_json(
        folder / "tokenizer_config.json",
        {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "add_bos_token": False,
            "chat_template": CHATML_TEMPLATE,
            "model_max_length": max_position_embeddings,
        },
    )
    _write_weights(folder, tiny_llama_weights(arch, seed=seed), dtype=dtype, shards=shards)
    return folder


def tiny_llama_weights(arch: LlamaArchConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """The float32 weights :func:`make_tiny_llama` writes for ``arch`` and ``seed``."""
    rng = np.random.default_rng(seed)
    h, d = arch.hidden_size, arch.head_dim

    def linear(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def norm() -> np.ndarray:  # not all ones, so swapping two norms changes the output
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((arch.vocab_size, h)).astype(np.float32)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = linear(arch.num_attention_heads * d, h, 1.5)
        weights[p + "self_attn.k_proj.weight"] = linear(arch.num_key_value_heads * d, h, 1.5)
        weights[p + "self_attn.v_proj.weight"] = linear(arch.num_key_value_heads * d, h)
        weights[p + "self_attn.o_proj.weight"] = linear(h, arch.num_attention_heads * d)
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = linear(arch.intermediate_size, h)
        weights[p + "mlp.up_proj.weight"] = linear(arch.intermediate_size, h)
        weights[p + "mlp.down_proj.weight"] = linear(h, arch.intermediate_size)
    weights["model.norm.weight"] = norm()
    if not arch.tie_word_embeddings:
        weights["lm_head.weight"] = linear(arch.vocab_size, h, 3.0)
    return weights


def make_tiny_checkpoint(folder: str | Path, config: Mapping[str, object], *, seed: int = 0) -> Path:
    """Write a random model of Hugging Face ``config`` (any architecture an installed plugin serves,
    vocabulary of at least 400) with the tiny Llama's trained tokenizer into ``folder``; return it.

    Matrices are drawn with spread ``1 / sqrt(fan_in)`` and norms around 1, so greedy choices are
    clear; the tensor set is exactly what the plugin's ``weight_shapes`` lists.
    """
    from fd_core.model.architectures import ArchitecturePlugins

    folder = make_tiny_llama(folder, vocab=int(config["vocab_size"]), seed=seed)
    plugin = ArchitecturePlugins().for_hf(list(config["architectures"]), str(folder))
    shapes = plugin.weight_shapes(plugin.parse_hf_config(config, {}))
    rng = np.random.default_rng(seed)
    weights = {name: (rng.standard_normal(size) * (size[-1] ** -0.5 if len(size) == 2 else 0.1)
                      + (1.0 if name.endswith("norm.weight") else 0.0)).astype(np.float32)
               for name, size in shapes.items()}
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    _write_weights(folder, weights, dtype="float32", shards=1)
    _write_json(folder / "config.json", dict(config))
    return folder


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to the nearest bfloat16 (ties to even), returned as bfloat16 bits (uint16)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    return (rounded >> 16).astype(np.uint16)


#: Hugging Face architecture -> the GGUF architecture llama.cpp's converter writes it as.
GGUF_ARCHITECTURE_NAMES: Final = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite", "SmolLM3ForCausalLM": "smollm3",
    "Ernie4_5ForCausalLM": "ernie4_5", "Ernie4_5_MoeForCausalLM": "ernie4_5-moe",
}
#: GGUF architectures whose converter class derives from llama.cpp's ``LlamaModel``: q/k rows permuted
#: for interleaved RoPE, ``vocab_size`` and ``rope.dimension_count`` written, llama3 RoPE as a tensor.
_LLAMA_MODELS: Final = frozenset({"llama", "granite", "smollm3"})


def write_tiny_gguf(
    path: str | Path,
    folder: str | Path,
    *,
    tensor_type: str = "F32",
    tensor_types: Mapping[str, str] | None = None,
) -> Path:
    """Convert the Hugging Face folder ``folder`` into a GGUF file at ``path`` as llama.cpp's
    ``convert_hf_to_gguf.py`` writes it: its metadata keys, its tensor names (gguf-py's
    ``TensorNameMap``, as the converter maps them) and its changes to the tensors; return ``path``.

    Architectures: those of :data:`GGUF_ARCHITECTURE_NAMES`. A model the file would not hold as it
    is raises ValueError instead of writing another model: llama.cpp fixes what some files leave out
    (Gemma 3's sliding-layer pattern and query scale, SmolLM3's layers without RoPE, Qwen3-MoE's
    renormalised experts) and its converter cannot map every layout. Matrices (2-D, and a layer's
    experts merged into 3-D) are stored as ``tensor_type`` (F32, F16, Q8_0, Q4_0, Q4_1, or any type
    ``gguf.quants.quantize`` supports); norms, biases, RoPE factors and MoE routers stay F32 as in
    llama.cpp. ``tensor_types`` overrides the type of single tensors by GGUF name
    (``{"blk.0.ffn_down.weight": "Q5_0"}``).
    """
    import gguf

    from fd_core.model.hf_loader import load_hf_folder

    folder, path = Path(folder), Path(path)
    arch, weights = load_hf_folder(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    gguf_arch = GGUF_ARCHITECTURE_NAMES[arch.architecture]
    _refuse_lossy(arch, gguf_arch)

    writer = gguf.GGUFWriter(path, gguf_arch)
    writer.add_name(folder.name)
    _add_hparams(writer, arch, config, gguf_arch)
    _add_tokenizer(writer, tok, tok_config, arch.vocab_size)
    overrides = dict(tensor_types or {})
    for name, value in _converted_tensors(arch, weights, gguf_arch):
        matrix = value.ndim > 1 and name.endswith(".weight") and ".ffn_gate_inp." not in name
        qtype = gguf.GGMLQuantizationType[overrides.pop(name, tensor_type if matrix else "F32")]
        data = gguf.quants.quantize(value, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    assert not overrides, f"tensor_types names tensors the model does not have: {sorted(overrides)}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refuse_lossy(arch: LlamaArchConfig, gguf_arch: str) -> None:
    """Raise ValueError naming what the converter's file would not hold of ``arch``."""
    layers, p = arch.num_hidden_layers, arch.rope_params
    gemma_scalar = arch.hidden_size // arch.num_attention_heads if layers == 62 else arch.head_dim
    moe_layers = arch.moe_layers or (0,)
    step = moe_layers[1] - moe_layers[0] if len(moe_layers) > 1 else 1
    rope_types = {"default", "dynamic", "linear", "yarn"} | ({"llama3"} if gguf_arch in _LLAMA_MODELS else set())
    lost = [
        (arch.rope_type not in ({"default", "longrope"} if gguf_arch == "phi3" else rope_types),
         f"{arch.rope_type} RoPE"),
        (arch.rope_type == "yarn" and bool(p.keys() - {"factor", "original_max_position_embeddings", "beta_fast",
                                                       "beta_slow"}), "yarn settings other than factor and betas"),
        (arch.rope_type == "longrope" and "attention_factor" in p, "longrope's attention_factor"),
        (arch.partial_rotary_factor != 1.0 and gguf_arch != "phi3", "partial rotary"),
        (gguf_arch == "granite" and arch.head_dim * arch.num_attention_heads != arch.hidden_size, "head_dim"),
        (bool(arch.sliding_layers) and gguf_arch not in ("gemma3", "phi3"), "a sliding window"),
        (gguf_arch == "gemma3" and arch.sliding_layers not in ((), tuple(i for i in range(layers) if (i + 1) % 6)),
         "sliding layers other than all but every sixth"),
        (gguf_arch == "gemma3" and arch.attention_multiplier != gemma_scalar ** -0.5,
         f"a query_pre_attn_scalar other than {gemma_scalar}"),
        (gguf_arch == "smollm3" and arch.no_rope_layers != tuple(range(3, layers, 4)),
         "layers without RoPE other than every fourth"),
        (gguf_arch == "qwen3moe" and arch.moe_layers != tuple(range(layers)), "dense layers"),
        (gguf_arch == "qwen3moe" and not arch.moe.renormalize, "norm_topk_prob false"),
        (gguf_arch == "ernie4_5-moe" and arch.moe_layers != tuple(i for i in range(moe_layers[0], layers)
                                                                  if (i + 1) % step == 0),
         "MoE layers other than every step-th from the first"),
        (gguf_arch == "ernie4_5-moe" and arch.moe.shared_intermediate_size not in
         (0, arch.intermediate_size // arch.num_key_value_heads),
         "shared experts of other than intermediate_size / num_key_value_heads rows (the converter's size)"),
    ]
    for condition, what in lost:
        if condition:
            raise ValueError(f"a {gguf_arch} GGUF file as llama.cpp writes it cannot hold {what}")


def _add_hparams(writer: gguf.GGUFWriter, arch: LlamaArchConfig, config: Mapping[str, Any], gguf_arch: str) -> None:
    """The ``<arch>.*`` keys the converter writes for ``config`` (``arch``: its parsed shape)."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_hidden_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_attention_heads)
    writer.add_head_count_kv(arch.num_key_value_heads)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_rope_freq_base(arch.rope_theta)
    if gguf_arch == "gemma3" or ("head_dim" in config and gguf_arch not in ("granite", "phi3")):
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    if gguf_arch in _LLAMA_MODELS | {"phi3"}:
        writer.add_rope_dimension_count(arch.rope.rotary_dim(arch.head_dim))
    if gguf_arch in _LLAMA_MODELS:
        writer.add_vocab_size(arch.vocab_size)
    _add_rope_scaling(writer, arch, config, gguf_arch)
    if gguf_arch == "gemma3":
        writer.add_rope_freq_base_swa(arch.local_rope_theta)
        if arch.sliding_window:
            writer.add_sliding_window(arch.sliding_window)
        if arch.final_logit_softcapping:
            writer.add_final_logit_softcapping(arch.final_logit_softcapping)
    if gguf_arch == "phi3":   # 0: none
        writer.add_sliding_window(config.get("sliding_window") or 0)
    if gguf_arch == "granite":
        for key, add in (("attention_multiplier", writer.add_attention_scale),
                         ("embedding_multiplier", writer.add_embedding_scale),
                         ("residual_multiplier", writer.add_residual_scale),
                         ("logits_scaling", writer.add_logit_scale)):
            if config.get(key):
                add(config[key])
    if arch.moe is not None:
        _add_experts(writer, arch, gguf_arch)


def _add_rope_scaling(writer: gguf.GGUFWriter, arch: LlamaArchConfig, config: Mapping[str, Any],
                      gguf_arch: str) -> None:
    """Linear and yarn RoPE scaling as keys; Phi-3's pre-trained window and longrope attention factor
    (its factors, and llama3's, are tensors: :func:`_rope_tensors`)."""
    import gguf

    p = arch.rope_params
    if gguf_arch == "phi3":
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        if arch.rope_type == "longrope":
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1
                                                 else 1.0)
    elif arch.rope_type in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(arch.rope_type))
        writer.add_rope_scaling_factor(p["factor"])
    if arch.rope_type == "yarn":
        writer.add_rope_scaling_orig_ctx_len(p["original_max_position_embeddings"])
        if p.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(p["beta_fast"])
        if p.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(p["beta_slow"])


def _add_experts(writer: gguf.GGUFWriter, arch: LlamaArchConfig, gguf_arch: str) -> None:
    """The experts' keys: ERNIE's also its dense lead, MoE layer step and shared experts (their size
    as the converter computes it, intermediate_size / num_key_value_heads)."""
    moe = arch.moe
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    writer.add_expert_feed_forward_length(moe.intermediate_size)
    if gguf_arch == "ernie4_5-moe":
        first, *rest = arch.moe_layers
        writer.add_interleave_moe_layer_step(rest[0] - first if rest else 1)
        writer.add_leading_dense_block_count(first)
        writer.add_expert_shared_count(moe.shared_intermediate_size // moe.intermediate_size)
        if moe.shared_intermediate_size:
            writer.add_expert_shared_feed_forward_length(arch.intermediate_size // arch.num_key_value_heads)


def _converted_tensors(arch: LlamaArchConfig, weights: Mapping[str, np.ndarray],
                       gguf_arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """The converter's tensors: the RoPE tensors it generates, then the checkpoint's, named by
    gguf-py's ``TensorNameMap`` and changed as it changes them (q/k rows permuted for the
    ``LlamaModel`` architectures, Gemma's norms with their 1 added)."""
    import gguf

    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == gguf_arch)
    names = gguf.get_tensor_name_map(model_arch, arch.num_hidden_layers)
    yield from _rope_tensors(arch)
    for hf_name, value in _checkpoint_tensors(arch, weights).items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"llama.cpp's converter cannot map {hf_name} of a {gguf_arch} model")
        if gguf_arch in _LLAMA_MODELS and ".q_proj." in hf_name:
            value = _permute(value, arch.num_attention_heads)
        elif gguf_arch in _LLAMA_MODELS and ".k_proj." in hf_name:
            value = _permute(value, arch.num_key_value_heads)
        elif gguf_arch == "gemma3" and hf_name.endswith("norm.weight"):
            value = value + np.float32(1.0)
        yield gguf_name, value


def _checkpoint_tensors(arch: LlamaArchConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as the converter gets and merges them: Phi-3's q/k/v and gate/up fused
    (as its checkpoints hold them), a layer's experts stacked per projection, ERNIE's score
    correction renamed to a bias."""
    tensors = dict(weights)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        if arch.architecture == "Phi3ForCausalLM":
            tensors[f"{p}self_attn.qkv_proj.weight"] = np.concatenate(
                [tensors.pop(f"{p}self_attn.{x}_proj.weight") for x in "qkv"])
            tensors[f"{p}mlp.gate_up_proj.weight"] = np.concatenate(
                [tensors.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")])
        if i in arch.moe_layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"{p}mlp.experts.{proj}.weight"] = np.stack(
                    [tensors.pop(f"{p}mlp.experts.{e}.{proj}.weight") for e in range(arch.moe.num_experts)])
            if arch.moe.score_correction:
                tensors[f"{p}mlp.moe_statics.e_score_correction.bias"] = tensors.pop(
                    f"{p}mlp.moe_statics.e_score_correction_bias")
    return tensors


def _rope_tensors(arch: LlamaArchConfig) -> list[tuple[str, np.ndarray]]:
    """The RoPE tensors the converter generates: llama3's per-frequency factors, Phi-3's long and
    short factors."""
    if arch.rope_type == "llama3":
        return [("rope_freqs.weight", _llama3_rope_factors(arch))]
    if arch.rope_type == "longrope":
        return [(f"rope_factors_{kind}.weight", np.asarray(arch.rope_params[f"{kind}_factor"], dtype=np.float32))
                for kind in ("long", "short")]
    return []


def _add_tokenizer(writer: gguf.GGUFWriter, tok: dict, tok_config: dict, vocab_size: int) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` as GGUF ``tokenizer.*`` metadata; a
    vocabulary smaller than the model's ``vocab_size`` is padded with unused ``[PAD<id>]`` tokens,
    as llama.cpp's converter pads it (llama.cpp wants a token per embedding row)."""
    import gguf

    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab |= {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids are not contiguous"
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    padding = range(len(tokens), vocab_size)
    tokens += [f"[PAD{i}]" for i in padding]
    types += [gguf.TokenType.UNUSED] * len(padding)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # Digits(individual) + GPT-2 regex, as the folder's tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    writer.add_chat_template(tok_config["chat_template"])


def _llama3_rope_factors(arch: LlamaArchConfig) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for ``llama3`` RoPE scaling: per frequency,
    what divides it (1 for high frequencies, ``factor`` for low ones, smoothly between)."""
    p = arch.rope_params
    freqs = 1.0 / (arch.rope_theta ** (np.arange(0, arch.head_dim, 2, dtype=np.float32) / arch.head_dim))
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = ((p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"])
                      / (p["high_freq_factor"] - p["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp ``LlamaModel.permute``: per head, rows of two halves -> interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab: int) -> str:
    """A byte-level BPE with SmolLM2's pre-tokenizer, trained on fixed text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    minimum = len(byte_level.alphabet()) + len(TINY_SPECIAL_TOKENS)
    if vocab < minimum:
        raise ValueError(f"vocab={vocab} is below the byte-level minimum {minimum}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=byte_level.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer)
    return tok.to_str()


def _write_weights(folder: Path, weights: dict[str, np.ndarray], *, dtype: str, shards: int) -> None:
    if shards == 1:
        _write_safetensors(folder / "model.safetensors", weights, dtype=dtype)
        return
    names = list(weights)
    weight_map = {}
    for i, group in enumerate((names[i::shards] for i in range(shards)), start=1):
        filename = f"model-{i:05d}-of-{shards:05d}.safetensors"
        _write_safetensors(folder / filename, {n: weights[n] for n in group}, dtype=dtype)
        weight_map |= dict.fromkeys(group, filename)
    _write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], *, dtype: str) -> None:
    """Write the safetensors format by hand (numpy cannot express bfloat16)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, value in tensors.items():
        blob = (round_to_bfloat16(value) if dtype == "bfloat16" else value.astype("<f4")).tobytes()
        header[name] = {
            "dtype": "BF16" if dtype == "bfloat16" else "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
