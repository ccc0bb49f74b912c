"""Write tiny random Llama models (Hugging Face folder and GGUF file) for tests, with numpy only.

:func:`make_tiny_llama` writes a complete Hugging Face folder: ``config.json``,
``model.safetensors`` (float32 or bfloat16, optionally sharded), ``generation_config.json``,
``tokenizer.json`` (a byte-level BPE trained deterministically on fixed text, SmolLM2-style
pre-tokenizer) and ``tokenizer_config.json`` with a ChatML template. :func:`write_tiny_gguf`
turns such a folder into a GGUF file the way llama.cpp's converter would (Q/K rows permuted for
interleaved RoPE), in any tensor type ``gguf.quants`` can quantize.

Weights are random but not near-uniform (embeddings N(0, 1), Q/K gain 1.5, lm_head gain 3), so
greedy decoding is decisive and layout mistakes change the output.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

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


def write_tiny_gguf(
    path: str | Path,
    folder: str | Path,
    *,
    tensor_type: str = "F32",
    tensor_types: Mapping[str, str] | None = None,
) -> Path:
    """Convert the Hugging Face folder ``folder`` (Llama, Qwen2 or Qwen3) into a GGUF file at ``path``
    as llama.cpp's converter writes it; return ``path``.

    2-D tensors are stored as ``tensor_type`` (F32, F16, Q8_0, Q4_0, Q4_1, or any type
    ``gguf.quants.quantize`` supports); norms stay F32 as in llama.cpp. ``tensor_types`` overrides
    the type of single tensors by GGUF name (``{"blk.0.ffn_down.weight": "Q5_0"}``). Q and K
    rows of llama files are permuted as llama.cpp's ``convert_hf_to_gguf.py`` does.
    """
    import gguf

    from fd_core.model.hf_loader import load_hf_folder

    folder, path = Path(folder), Path(path)
    arch, weights = load_hf_folder(folder)
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))

    gguf_arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        arch.architecture]
    writer = gguf.GGUFWriter(path, gguf_arch)
    writer.add_name(folder.name)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_hidden_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_attention_heads)
    writer.add_head_count_kv(arch.num_key_value_heads)
    writer.add_rope_dimension_count(arch.head_dim)
    if arch.head_dim * arch.num_attention_heads != arch.hidden_size:
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    if arch.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(arch.rope_params["factor"])
    elif arch.rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(arch))
    elif arch.rope_type != "default":
        raise ValueError(f"no GGUF form for rope_type {arch.rope_type!r} here")
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(arch.vocab_size)
    _add_tokenizer(writer, tok, tok_config)

    overrides = dict(tensor_types or {})
    for hf_name, gguf_name in _gguf_names(arch):
        w = weights[hf_name]
        if gguf_arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = arch.num_attention_heads if "attn_q" in gguf_name else arch.num_key_value_heads
            w = _permute(w, heads)
        qtype = gguf.GGMLQuantizationType[overrides.pop(gguf_name, tensor_type if w.ndim == 2 else "F32")]
        data = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    assert not overrides, f"tensor_types names tensors the model does not have: {sorted(overrides)}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, tok: dict, tok_config: dict) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` as GGUF ``tokenizer.*`` metadata."""
    import gguf

    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab |= {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids are not contiguous"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # Digits(individual) + GPT-2 regex, as the folder's tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    writer.add_chat_template(tok_config["chat_template"])


def _gguf_names(arch: LlamaArchConfig) -> list[tuple[str, str]]:
    """(Hugging Face name, GGUF name) of every weight, in llama.cpp's file order."""
    names = [("model.embed_tokens.weight", "token_embd.weight")]
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if arch.qk_norm:
        parts |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    biased = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if arch.attention_bias else ()
    for i in range(arch.num_hidden_layers):
        names += [(f"model.layers.{i}.{hf}.weight", f"blk.{i}.{g}.weight") for hf, g in parts.items()]
        names += [(f"model.layers.{i}.{hf}.bias", f"blk.{i}.{parts[hf]}.bias") for hf in biased]
    names.append(("model.norm.weight", "output_norm.weight"))
    if not arch.tie_word_embeddings:
        names.append(("lm_head.weight", "output.weight"))
    return names


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
