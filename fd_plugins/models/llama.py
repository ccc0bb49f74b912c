"""The built-in Llama-family architecture: Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3 (and MoE), Granite,
SmolLM3, Phi-3, ERNIE 4.5 (dense and MoE) and Gemma 3 (text).

One decoder (``fd_core.model.llama``) with switches: q/k/v biases (Qwen2), an o_proj bias
(``attention_bias`` on Llama / Qwen3), per-head q/k RMSNorm (Qwen3, Gemma 3), Granite's embedding,
attention, residual and logit multipliers, SmolLM3's layers without RoPE, ERNIE's interleaved and
Phi's partial RoPE, Gemma 3's (1 + w) sandwich norms, GeGLU, embedding scale, logit soft-capping
and per-layer RoPE base, mixture-of-experts MLPs, sliding-window layers (Mistral, Phi-3, Qwen with
``use_sliding_window``, Gemma 3's ``layer_types``), and every RoPE scaling of ``fd_core.model.rope``
(Llama 3.1-3.3's ``llama3``, ``linear``, ``dynamic``, ``yarn``, ``longrope``).

Every key of ``config.json`` is read, listed in :data:`NO_EFFECT` (it changes nothing at
inference), or refused by name. GGUF files of these families as llama.cpp's converter writes them
(:data:`GGUF_ARCHITECTURES`) are parsed by the same rule: every ``<arch>.*`` key is read
(:data:`GGUF_KEYS`, :data:`GGUF_FAMILY_KEYS`) or refused by name, and what llama.cpp fixes rather than
stores (Gemma 3's layer pattern, SmolLM3's layers without RoPE...) is taken as llama.cpp takes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

import numpy as np

from fd_core.contracts.architecture import ArchitectureConfigError, ModelArchitecture, ModelPrecision
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.model.arch import LlamaArchConfig, MoeShape
from fd_core.model.rope import FREQ_FACTORS, RopeConfigError, RopeScaling, parse_rope
from fd_core.model.tokenizer import gguf_eos_token_ids
from fd_kernels.quantized import BlockQuantized

#: Hugging Face architecture -> (its model_type, whether q/k/v always carry biases).
ARCHITECTURES: Final[dict[str, tuple[str, bool]]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "Qwen3ForCausalLM": ("qwen3", False),
    "GraniteForCausalLM": ("granite", False),
    "SmolLM3ForCausalLM": ("smollm3", False),
    "Ernie4_5ForCausalLM": ("ernie4_5", False),
    "Phi3ForCausalLM": ("phi3", False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", False),
    "Gemma3ForCausalLM": ("gemma3_text", False),
}
#: model_type -> keys only that family's configs have (read by the parser).
FAMILY_KEYS: Final[dict[str, frozenset[str]]] = {
    "granite": frozenset({"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"}),
    "smollm3": frozenset({"no_rope_layers", "no_rope_layer_interval"}),
    "ernie4_5": frozenset({"use_bias"}),
    "phi3": frozenset({"original_max_position_embeddings", "partial_rotary_factor"}),
    "qwen3_moe": frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}),
    "ernie4_5_moe": frozenset({"use_bias", "moe_num_experts", "moe_k", "moe_intermediate_size",
                               "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
                               "moe_layer_interval", "moe_norm_min", "num_nextn_predict_layers"}),
    "gemma3_text": frozenset({"hidden_activation", "query_pre_attn_scalar", "sliding_window_pattern",
                              "_sliding_window_pattern", "rope_local_base_freq", "final_logit_softcapping",
                              "attn_logit_softcapping", "use_bidirectional_attention"}),
}

#: Keys the parser reads (their values decide the model).
READ: Final = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "hidden_act", "bos_token_id", "eos_token_id", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "use_mrope",
})
#: Keys that change nothing at inference, with why (transformers writes them into config.json).
NO_EFFECT: Final[dict[str, str]] = {
    **dict.fromkeys(("_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype",
                     "use_bfloat16"), "where the checkpoint came from and its storage dtype (read from the tensors)"),
    **dict.fromkeys(("use_cache", "initializer_range", "attention_dropout", "resid_pdrop", "embd_pdrop",
                     "pad_token_id", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
                     "torchscript", "tf_legacy_loss",
                     "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
                     "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "id2label",
                     "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "sep_token_id",
                     "decoder_start_token_id", "task_specific_params", "_attn_implementation",
                     "_attn_implementation_autoset", "pretraining_tp"),
                    "training, output-format or implementation settings (pretraining_tp splits the same "
                    "matrix products into slices)"),
    **dict.fromkeys(("max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
                     "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
                     "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
                     "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
                     "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
                     "suppress_tokens", "begin_suppress_tokens"),
                    "generation defaults: each request carries its own sampling settings"),
    **dict.fromkeys(("output_router_logits", "router_aux_loss_coef"), "mixture-of-experts training settings"),
    "cache_implementation": "transformers' choice of KV cache class",
}


#: GGUF ``general.architecture`` -> the Hugging Face architecture its files are (llama.cpp's converter
#: writes Mistral and Llama 1-3 as ``llama``).
GGUF_ARCHITECTURES: Final = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
}
#: The ``<arch>.*`` GGUF metadata keys (without the prefix) the GGUF parser reads in every architecture's
#: files. ``rope.scaling.original_context_length`` and the yarn betas change the model only beside yarn
#: scaling or Phi-3's factors (as in llama.cpp, which writes them there).
GGUF_KEYS: Final = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "vocab_size",
})
_GGUF_MOE_KEYS: Final = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length"})
#: GGUF architecture -> the keys only its files carry (read by the GGUF parser).
GGUF_FAMILY_KEYS: Final[dict[str, frozenset[str]]] = {
    "qwen3moe": _GGUF_MOE_KEYS,
    "ernie4_5-moe": _GGUF_MOE_KEYS | {"expert_shared_count", "expert_shared_feed_forward_length",
                                      "leading_dense_block_count", "interleave_moe_layer_step"},
    "gemma3": frozenset({"attention.sliding_window", "rope.freq_base_swa", "final_logit_softcapping"}),
    "phi3": frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
    "granite": frozenset({"attention.scale", "embedding_scale", "residual_scale", "logit_scale"}),
}
#: GGUF architectures whose RoPE rotates pairs (2i, 2i + 1) in Hugging Face's layout too (llama.cpp's
#: converter stores their q/k rows as they are).
GGUF_INTERLEAVED_ROPE: Final = frozenset({"ernie4_5", "ernie4_5-moe"})


class LlamaFamily(ModelArchitecture):
    """The decoders of the module docstring's families (``fd_core.model.llama``)."""

    name: ClassVar[str] = "llama"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    hf_architectures: ClassVar[tuple[str, ...]] = tuple(ARCHITECTURES)
    gguf_architectures: ClassVar[tuple[str, ...]] = tuple(GGUF_ARCHITECTURES)

    def parse_hf_config(self, config: Mapping[str, Any], generation: Mapping[str, Any]) -> LlamaArchConfig:
        architecture = _architecture(config)
        model_type, qkv_bias = ARCHITECTURES[architecture]
        unknown = sorted(config.keys() - READ - NO_EFFECT.keys() - FAMILY_KEYS.get(model_type, frozenset()))
        if unknown:
            raise ArchitectureConfigError(unknown[0], f"is not a key the Llama-family plugin understands for "
                                                      f"{architecture} (an ignored key could mean another model)")
        gemma = model_type == "gemma3_text"
        if gemma:
            _expect(config, "hidden_activation", "gelu_pytorch_tanh")
            _expect(config, "attn_logit_softcapping", None)
            _expect(config, "use_bidirectional_attention", False)
        _expect(config, "hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
        _expect(config, "mlp_bias", False)
        _expect(config, "use_mrope", False)
        _expect(config, "use_bias", False)
        heads = _get(config, "num_attention_heads")
        attention_bias = bool(config.get("attention_bias", False))
        try:
            rope, local_theta = _gemma_ropes(config) if gemma else (parse_rope(config), None)
        except RopeConfigError as e:
            raise ArchitectureConfigError(e.key, str(e).removeprefix(f"{e.key}: ")) from e
        context = rope.context_length(config.get("max_position_embeddings", 2048))
        head_dim = config.get("head_dim") or _get(config, "hidden_size") // heads
        rotary = rope.rotary_dim(head_dim)
        if rotary % 2 or (head_dim - rotary) % 2:
            raise ArchitectureConfigError("partial_rotary_factor", f"rotates {rotary} of {head_dim} dimensions; "
                                                                   "both parts must be even")
        window, sliding = _sliding_layers(config, model_type)
        if window is None or window >= context:   # a window as long as the context changes nothing
            window, sliding = None, ()
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        try:
            return LlamaArchConfig(
                architecture=architecture,
                vocab_size=_get(config, "vocab_size"),
                hidden_size=_get(config, "hidden_size"),
                intermediate_size=_get(config, "intermediate_size"),
                num_hidden_layers=_get(config, "num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=config.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                max_position_embeddings=context,
                rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=rope.theta,
                rope_type=rope.type,
                rope_params=dict(rope.params),
                partial_rotary_factor=rope.partial_rotary_factor,
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                attention_bias=qkv_bias or attention_bias,
                output_bias=attention_bias and not qkv_bias,
                qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
                interleaved_rope=model_type in ("ernie4_5", "ernie4_5_moe"),
                no_rope_layers=_no_rope_layers(config) if model_type == "smollm3" else (),
                embedding_multiplier=config.get("embedding_multiplier", _get(config, "hidden_size") ** 0.5 if gemma
                                                else 1.0),
                attention_multiplier=(config.get("query_pre_attn_scalar", head_dim) ** -0.5 if gemma
                                      else config.get("attention_multiplier")),
                residual_multiplier=config.get("residual_multiplier", 1.0),
                logits_scaling=config.get("logits_scaling", 1.0),
                hidden_act="gelu_pytorch_tanh" if gemma else "silu",
                norm_weight_offset=1.0 if gemma else 0.0,
                sandwich_norms=gemma,
                sliding_window=window,
                sliding_layers=sliding,
                local_rope_theta=local_theta,
                final_logit_softcapping=config.get("final_logit_softcapping"),
                **_experts(config, model_type),
                bos_token_id=generation.get("bos_token_id", config.get("bos_token_id")),
                eos_token_ids=tuple([eos] if isinstance(eos, int) else eos or ()),
            )
        except ValueError as e:
            raise ArchitectureConfigError("num_key_value_heads", str(e)) from e

    def tiny_hf_configs(self) -> dict[str, dict[str, Any]]:
        base = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
        llama = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        qwen3 = {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32}
        gemma3 = {key: value for key, value in base.items() if key not in ("hidden_act", "rope_theta")} | {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 32, "num_hidden_layers": 4,
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 16, "query_pre_attn_scalar": 32,
            "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
        return {
            "llama_tied": {**llama, "tie_word_embeddings": True, "num_key_value_heads": 4},
            "llama3_rope": {**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
            "llama_linear_rope": {**llama, "rope_scaling": {"type": "linear", "factor": 4.0}},
            "llama_dynamic_rope": {**llama, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "llama_yarn_rope": {**llama, "max_position_embeddings": 128, "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 16.0, "beta_slow": 2.0}},
            "llama_attention_bias": {**llama, "attention_bias": True, "head_dim": 32},
            "mistral_window": {**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                               "sliding_window": 24},
            "qwen2_window": {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                             "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
            "gemma3": {**gemma3, "rope_theta": 100000.0, "rope_local_base_freq": 10000.0,
                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window_pattern": 2},
            "gemma3_softcap": {**gemma3, "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                               "sliding_attention"],
                               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
            "qwen2": {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                      "tie_word_embeddings": True},
            "qwen3": qwen3,
            "granite": {**base, "architectures": ["GraniteForCausalLM"], "model_type": "granite",
                        "embedding_multiplier": 6.0, "attention_multiplier": 0.11, "residual_multiplier": 0.4,
                        "logits_scaling": 4.0, "tie_word_embeddings": True},
            "smollm3": {**base, "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "pad_token_id": 0,
                        "num_hidden_layers": 4, "no_rope_layer_interval": 2, "tie_word_embeddings": True},
            "phi3_partial_longrope": {
                **base, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "pad_token_id": 0,
                "partial_rotary_factor": 0.75,
                "max_position_embeddings": 512, "original_max_position_embeddings": 128, "sliding_window": 2047,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                 "long_factor": [2.0 + i for i in range(6)]}},
            "qwen3_moe": {**qwen3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                          "num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [0]},
            "qwen3_moe_renormalized": {**qwen3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                       "num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                       "norm_topk_prob": True, "decoder_sparse_step": 2},
            "ernie4_5_moe": {**base, "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
                             "num_hidden_layers": 3, "head_dim": 32, "moe_num_experts": 6, "moe_k": 2,
                             "moe_intermediate_size": 32, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                             "moe_layer_end_index": 2, "pad_token_id": 0},
            "ernie4_5": {**base, "architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "head_dim": 32,
                         "use_bias": False, "rope_theta": 500000.0},
            "qwen3_bias_yarn": {**qwen3, "attention_bias": True, "rope_scaling": {
                "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}},
        }

    def parse_gguf(self, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]) -> LlamaArchConfig:
        """``<arch>.*`` keys (each read or refused by name), with llama.cpp's rules for what its files
        leave out (Gemma 3's layer pattern and query scale, SmolLM3's layers without RoPE, Qwen3-MoE's
        renormalised experts); ``tensor_shapes`` are GGUF (innermost-first) shapes."""
        meta = _GgufMetadata(metadata, metadata["general.architecture"])
        unknown = sorted(meta.keys() - GGUF_KEYS - GGUF_FAMILY_KEYS.get(meta.arch, frozenset()))
        if unknown:
            raise ArchitectureConfigError(meta.key(unknown[0]), f"is not a key the Llama-family plugin understands "
                                                                f"in {meta.arch} files")
        if "token_embd.weight" not in tensor_shapes:
            raise ArchitectureConfigError("token_embd.weight", "the tensor is missing")
        hidden, vocab = tensor_shapes["token_embd.weight"]
        heads, layers = meta.need("attention.head_count"), meta.need("block_count")
        head_dim = meta.get("attention.key_length", hidden // heads)
        for key, wanted in (("attention.value_length", head_dim), ("vocab_size", vocab)):
            if meta.get(key, wanted) != wanted:
                raise ArchitectureConfigError(meta.key(key), f"{meta.get(key)} is not supported "
                                                             f"(this file's layout needs {wanted})")
        rope = RopeScaling(_shortest(meta.get("rope.freq_base", 10000.0)), *_gguf_rope_scaling(meta, tensor_shapes),
                           _gguf_rotary_share(meta, head_dim))
        context = rope.context_length(meta.get("context_length", 2048))
        window, sliding = _gguf_sliding_layers(meta, layers)
        if window is None or window >= context:   # a window as long as the context changes nothing
            window, sliding = None, ()
        gemma = meta.arch == "gemma3"
        try:
            return LlamaArchConfig(
                architecture=GGUF_ARCHITECTURES[meta.arch],
                vocab_size=vocab,
                hidden_size=meta.need("embedding_length"),
                intermediate_size=meta.need("feed_forward_length"),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=meta.get("attention.head_count_kv", heads),
                head_dim=head_dim,
                max_position_embeddings=context,
                rms_norm_eps=_shortest(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=rope.theta,
                rope_type=rope.type,
                rope_params=dict(rope.params),
                partial_rotary_factor=rope.partial_rotary_factor,
                tie_word_embeddings="output.weight" not in tensor_shapes,
                attention_bias="blk.0.attn_q.bias" in tensor_shapes,
                output_bias="blk.0.attn_output.bias" in tensor_shapes,
                qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
                interleaved_rope=meta.arch in GGUF_INTERLEAVED_ROPE,
                # llama.cpp: every fourth SmolLM3 layer has no RoPE (its files do not say which)
                no_rope_layers=tuple(range(3, layers, 4)) if meta.arch == "smollm3" else (),
                **_gguf_multipliers(meta, hidden, heads, head_dim, layers),
                hidden_act="gelu_pytorch_tanh" if gemma else "silu",
                sandwich_norms=gemma,   # its files hold the norms with Gemma's 1 added: no norm_weight_offset
                sliding_window=window,
                sliding_layers=sliding,
                local_rope_theta=_shortest(meta.get("rope.freq_base_swa", 10000.0)) if gemma else None,
                final_logit_softcapping=_shortest(meta.get("final_logit_softcapping")),
                **_gguf_experts(meta, layers),
                bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=gguf_eos_token_ids(metadata),
            )
        except ValueError as e:
            raise ArchitectureConfigError(meta.key("attention.head_count_kv"), str(e)) from e

    def prepare_weights(self, shape: LlamaArchConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Phi-3 checkpoints (and GGUF files) fuse ``qkv_proj`` and ``gate_up_proj``: split them into the
        Llama names."""
        q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        for name in [n for n in weights if n.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))]:
            fused = weights.pop(name)
            if name.endswith(".qkv_proj.weight"):
                prefix = name.removesuffix("qkv_proj.weight")
                parts = {"q_proj": q, "k_proj": kv, "v_proj": kv}
            else:
                prefix = name.removesuffix("gate_up_proj.weight")
                parts = {"gate_proj": shape.intermediate_size, "up_proj": shape.intermediate_size}
            if fused.shape[0] != sum(parts.values()):
                return {**weights, name: fused}   # weight_shapes' check names it
            for (part, rows), start in zip(parts.items(), np.cumsum([0, *parts.values()]), strict=False):
                weights[f"{prefix}{part}.weight"] = _rows(fused, start, start + rows)
        return weights

    def weight_shapes(self, shape: LlamaArchConfig) -> dict[str, tuple[int, ...]]:
        from fd_core.model.llama import weight_shapes

        return weight_shapes(shape)

    def build(self, shape: LlamaArchConfig, weights: Mapping[str, Any], *, kernels: Any,
              precision: ModelPrecision) -> Any:
        from fd_core.model.llama import LlamaForCausalLM

        return LlamaForCausalLM(shape, weights, dtype=precision.dtype, kernels=kernels,
                                linear_weights=precision.linear_weights, linear_inputs=precision.linear_inputs,
                                attention_inputs=precision.attention_inputs)


class _GgufMetadata:
    """A GGUF's metadata, its ``<arch>.*`` keys read by their names without the prefix."""

    def __init__(self, metadata: Mapping[str, Any], arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def key(self, name: str) -> str:
        """The full key of ``name``."""
        return f"{self.arch}.{name}"

    def keys(self) -> set[str]:
        """The names of the file's ``<arch>.*`` keys."""
        return {key.removeprefix(f"{self.arch}.") for key in self.metadata if key.startswith(f"{self.arch}.")}

    def get(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(self.key(name), default)

    def need(self, name: str) -> Any:
        """The value of ``name``; raises :class:`ArchitectureConfigError` naming it when it is missing."""
        if self.key(name) not in self.metadata:
            raise ArchitectureConfigError(self.key(name), "missing")
        return self.metadata[self.key(name)]


def _gguf_rope_scaling(meta: _GgufMetadata, tensor_shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, dict[str, Any]]:
    """A GGUF's RoPE scaling type and settings: llama.cpp's per-frequency factors (the ``rope_freqs``
    tensor: Llama 3.1-3.3), Phi-3's ``longrope`` (no type key; its factors are the ``rope_factors_*``
    tensors, read at build), ``linear`` and ``yarn`` with their keys, or none; anything else is
    refused by key."""
    kind = meta.get("rope.scaling.type", "none")
    tensor = next((name for name in ("rope_freqs.weight", "rope_factors_short.weight") if name in tensor_shapes), None)
    if tensor is not None and kind != "none":
        raise ArchitectureConfigError(meta.key("rope.scaling.type"), f"{kind!r} beside a {tensor} tensor")
    if meta.get("rope.scaling.attn_factor") is not None and tensor != "rope_factors_short.weight":
        raise ArchitectureConfigError(meta.key("rope.scaling.attn_factor"), "only Phi-3's rope_factors take it")
    if tensor == "rope_freqs.weight":
        return FREQ_FACTORS, {}
    if tensor is not None:   # as transformers: the factor is max_position_embeddings over the pre-trained window
        original = meta.need("rope.scaling.original_context_length")
        return "longrope", {"original_max_position_embeddings": original,
                            "factor": meta.need("context_length") / original,
                            "attention_factor": float(meta.get("rope.scaling.attn_factor", 1.0))}
    if kind == "linear":
        return "linear", {"factor": _shortest(meta.need("rope.scaling.factor"))}
    if kind == "yarn":
        params = {"factor": _shortest(meta.need("rope.scaling.factor")),
                  "original_max_position_embeddings": meta.need("rope.scaling.original_context_length")}
        for setting in ("beta_fast", "beta_slow"):
            if meta.get(f"rope.scaling.yarn_{setting}") is not None:
                params[setting] = _shortest(meta.get(f"rope.scaling.yarn_{setting}"))
        return "yarn", params
    if kind != "none":
        raise ArchitectureConfigError(meta.key("rope.scaling.type"), f"{kind!r} is not supported in GGUF files "
                                                                     "(none, linear, yarn and rope factor tensors are)")
    if meta.get("rope.scaling.factor", 1.0) != 1.0:   # llama.cpp would scale the frequencies by it
        raise ArchitectureConfigError(meta.key("rope.scaling.factor"), "needs rope.scaling.type linear or yarn")
    return "default", {}


def _gguf_rotary_share(meta: _GgufMetadata, head_dim: int) -> float:
    """The share of each head ``rope.dimension_count`` rotates; only Phi-3's files rotate part of it."""
    rotary = meta.get("rope.dimension_count", head_dim)
    if rotary != head_dim and (meta.arch != "phi3" or not 0 < rotary < head_dim or rotary % 2 or head_dim % 2):
        raise ArchitectureConfigError(meta.key("rope.dimension_count"), f"{rotary} is not supported "
                                                                        f"(this file's heads have {head_dim})")
    return rotary / head_dim


def _gguf_sliding_layers(meta: _GgufMetadata, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The attention window and its layers: every layer (Phi-3), or all but every sixth (Gemma 3:
    llama.cpp's fixed pattern, which its files do not store)."""
    window = meta.get("attention.sliding_window") or None
    if window is None:
        return None, ()
    return window, tuple(i for i in range(layers) if meta.arch != "gemma3" or (i + 1) % 6)


def _gguf_multipliers(meta: _GgufMetadata, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    """Embedding, attention, residual and logit scales: Granite's keys, or Gemma 3's llama.cpp rules (the
    embedding times sqrt(hidden); queries by ``query_pre_attn_scalar``, which its files leave out:
    hidden / heads for the 27B model, which llama.cpp knows by its 62 layers, head_dim for the others)."""
    if meta.arch == "gemma3":
        scalar = hidden // heads if layers == 62 else head_dim
        return {"embedding_multiplier": hidden ** 0.5, "attention_multiplier": scalar ** -0.5}
    return {"embedding_multiplier": _shortest(meta.get("embedding_scale", 1.0)),
            "attention_multiplier": _shortest(meta.get("attention.scale")),
            "residual_multiplier": _shortest(meta.get("residual_scale", 1.0)),
            "logits_scaling": _shortest(meta.get("logit_scale", 1.0))}


def _gguf_experts(meta: _GgufMetadata, layers: int) -> dict[str, Any]:
    """``moe`` and ``moe_layers`` of a Qwen3-MoE or ERNIE 4.5 MoE file, by llama.cpp's rules: every
    Qwen3-MoE layer has experts, their weights renormalised; ERNIE's layers from
    ``leading_dense_block_count`` on, every ``interleave_moe_layer_step``-th, with score correction and
    ``expert_shared_feed_forward_length`` of shared experts."""
    if meta.arch not in ("qwen3moe", "ernie4_5-moe"):
        return {}
    experts, top_k = meta.need("expert_count"), meta.need("expert_used_count")
    if not 0 < top_k <= experts:
        raise ArchitectureConfigError(meta.key("expert_used_count"), f"{top_k} is not in 1..expert_count={experts}")
    size = meta.need("expert_feed_forward_length")
    if meta.arch == "qwen3moe":
        return {"moe": MoeShape(experts, top_k, size, renormalize=True), "moe_layers": tuple(range(layers))}
    shared = meta.need("expert_shared_feed_forward_length") if meta.get("expert_shared_count", 0) else 0
    first, step = meta.get("leading_dense_block_count", 0), meta.get("interleave_moe_layer_step", 1)
    if step < 1:
        raise ArchitectureConfigError(meta.key("interleave_moe_layer_step"), f"{step} is not a layer step")
    shape = MoeShape(experts, top_k, size, renormalize=True, norm_min=1e-12, score_correction=True,
                     shared_intermediate_size=shared)
    return {"moe": shape, "moe_layers": tuple(i for i in range(first, layers) if (i + 1) % step == 0)}


def _shortest(value: float | None) -> float | None:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return None if value is None else float(str(np.float32(value)))


def _rows(matrix: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a float32 matrix or of one kept in GGUF blocks."""
    return matrix.take_rows(np.arange(start, stop)) if isinstance(matrix, BlockQuantized) else matrix[start:stop]


def _architecture(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ArchitectureConfigError("architectures", f"{architectures!r}: the Llama-family plugin serves one of "
                                                       f"{', '.join(ARCHITECTURES)}")
    architecture = architectures[0]
    model_type = config.get("model_type", ARCHITECTURES[architecture][0])
    if model_type != ARCHITECTURES[architecture][0]:
        raise ArchitectureConfigError("model_type", f"{model_type!r} does not match architecture {architecture!r} "
                                                    f"(expected {ARCHITECTURES[architecture][0]!r})")
    return architecture


def _get(config: Mapping[str, Any], key: str) -> Any:
    if key not in config:
        raise ArchitectureConfigError(key, "missing")
    return config[key]


def _expect(config: Mapping[str, Any], key: str, value: Any) -> None:
    if config.get(key, value) != value:
        raise ArchitectureConfigError(key, f"{config[key]!r} is not supported (only {value!r})")


def _experts(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``moe`` and ``moe_layers`` of a Qwen3-MoE or ERNIE 4.5 MoE config (transformers' layer rules)."""
    layers = range(_get(config, "num_hidden_layers"))
    if model_type == "qwen3_moe":
        experts = config.get("num_experts", config.get("num_local_experts"))
        if experts is None:
            raise ArchitectureConfigError("num_experts", "missing")
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
        shape = MoeShape(experts, _get(config, "num_experts_per_tok"), _get(config, "moe_intermediate_size"),
                         renormalize=bool(config.get("norm_topk_prob", False)))
        return {"moe": shape, "moe_layers": tuple(i for i in layers if i not in dense and (i + 1) % step == 0)}
    if model_type == "ernie4_5_moe":
        if config.get("num_nextn_predict_layers"):
            raise ArchitectureConfigError("num_nextn_predict_layers", "multi-token prediction layers are not supported")
        size = _get(config, "moe_intermediate_size")
        shape = MoeShape(_get(config, "moe_num_experts"), _get(config, "moe_k"), size, renormalize=True,
                         norm_min=config.get("moe_norm_min", 1e-12), score_correction=True,
                         shared_intermediate_size=size * config.get("moe_num_shared_experts", 0))
        start, end = config.get("moe_layer_start_index", 0), config.get("moe_layer_end_index", len(layers) - 1)
        interval = config.get("moe_layer_interval", 1)
        return {"moe": shape, "moe_layers": tuple(i for i in layers if (i + 1) % interval == 0 and start <= i <= end)}
    return {}


def _no_rope_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """SmolLM3: the layers ``no_rope_layers`` marks 0 (1: the layer uses RoPE); without the list,
    every ``no_rope_layer_interval``-th layer (default 4), as transformers derives it."""
    layers = _get(config, "num_hidden_layers")
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or set(flags) - {0, 1}:
        raise ArchitectureConfigError("no_rope_layers", "needs one 0 or 1 per layer")
    return tuple(i for i, flag in enumerate(flags) if not flag)


def _sliding_layers(config: Mapping[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...]]:
    """The attention window and the layers that have it (transformers' rules per family)."""
    window, layers = config.get("sliding_window"), _get(config, "num_hidden_layers")
    if model_type in ("mistral", "phi3"):   # every layer has the window
        return window, tuple(range(layers)) if window else ()
    if model_type != "gemma3_text" and not config.get("use_sliding_window", False):
        return None, ()
    kinds = config.get("layer_types")
    if kinds is None:
        if model_type == "gemma3_text":
            pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:
            first = config.get("max_window_layers", 0)
            kinds = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise ArchitectureConfigError("layer_types", "needs full_attention or sliding_attention for each layer")
    sliding = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if sliding and not window:
        raise ArchitectureConfigError("sliding_window", "sliding_attention layers need a window")
    return (window, sliding) if sliding else (None, ())


def _gemma_ropes(config: Mapping[str, Any]) -> tuple[RopeScaling, float]:
    """Gemma 3: the global layers' RoPE and the sliding layers' base (its RoPE has no scaling), from
    per-layer-type ``rope_parameters`` or from ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    nested = config.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        unknown = sorted(nested.keys() - {"full_attention", "sliding_attention"})
        if unknown:
            raise RopeConfigError(f"rope_parameters.{unknown[0]}", "is not a layer type")
        rope = parse_rope({**config, "rope_parameters": nested.get("full_attention", {"rope_theta": 1e6}),
                           "rope_scaling": None})
        local = parse_rope({"rope_parameters": nested.get("sliding_attention", {"rope_theta": 1e4})})
    else:
        rope = parse_rope({"rope_theta": 1e6, **config})
        local = parse_rope({"rope_theta": config.get("rope_local_base_freq", 1e4)})
    if local.type != "default" or local.partial_rotary_factor != 1.0:
        raise RopeConfigError("rope_parameters.sliding_attention", "the sliding layers' RoPE must be unscaled")
    return rope, local.theta
