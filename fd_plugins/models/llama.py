"""The built-in Llama-family architecture: Llama 1-3.x, Mistral, Qwen2/2.5 and Qwen3.

One decoder (``fd_core.model.llama``) with switches: q/k/v biases (Qwen2), an o_proj bias
(``attention_bias`` on Llama / Qwen3), per-head q/k RMSNorm (Qwen3), and every RoPE scaling of
``fd_core.model.rope`` (Llama 3.1-3.3's ``llama3``, ``linear``, ``dynamic``, ``yarn``). A sliding
window (Mistral; Qwen2/3 with ``use_sliding_window``) shorter than the context caps the served
context at the window: within it, windowed attention is full attention, so the model stays exact.

Every key of ``config.json`` is read, listed in :data:`NO_EFFECT` (it changes nothing at
inference), or refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from fd_core.contracts.architecture import ArchitectureConfigError, ModelArchitecture, ModelPrecision
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.model.arch import LlamaArchConfig
from fd_core.model.rope import RopeConfigError, parse_rope

log = logging.getLogger(__name__)

#: Hugging Face architecture -> (its model_type, whether q/k/v always carry biases).
ARCHITECTURES: Final[dict[str, tuple[str, bool]]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "Qwen3ForCausalLM": ("qwen3", False),
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
    **dict.fromkeys(("use_cache", "initializer_range", "attention_dropout", "pad_token_id", "output_attentions",
                     "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "tf_legacy_loss",
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
}


class LlamaFamily(ModelArchitecture):
    """Llama, Mistral, Qwen2 and Qwen3 decoders (``fd_core.model.llama``)."""

    name: ClassVar[str] = "llama"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    hf_architectures: ClassVar[tuple[str, ...]] = tuple(ARCHITECTURES)
    gguf_architectures: ClassVar[tuple[str, ...]] = ("llama",)

    def parse_hf_config(self, config: Mapping[str, Any], generation: Mapping[str, Any]) -> LlamaArchConfig:
        unknown = sorted(config.keys() - READ - NO_EFFECT.keys())
        if unknown:
            raise ArchitectureConfigError(unknown[0], "is not a key the Llama-family plugin understands, and an "
                                                      "ignored key could mean a different model")
        architecture = _architecture(config)
        model_type, qkv_bias = ARCHITECTURES[architecture]
        _expect(config, "hidden_act", "silu")
        _expect(config, "mlp_bias", False)
        _expect(config, "use_mrope", False)
        heads = _get(config, "num_attention_heads")
        attention_bias = bool(config.get("attention_bias", False))
        try:
            rope = parse_rope(config)
        except RopeConfigError as e:
            raise ArchitectureConfigError(e.key, str(e).removeprefix(f"{e.key}: ")) from e
        context = rope.context_length(config.get("max_position_embeddings", 2048))
        window = _sliding_window(config, architecture)
        if window is not None and window < context:
            log.info("%s: sliding window of %d tokens: the served context is capped at it (windowed attention "
                     "over longer sequences is not implemented)", architecture, window)
            context = window
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
                head_dim=config.get("head_dim") or _get(config, "hidden_size") // heads,
                max_position_embeddings=context,
                rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=rope.theta,
                rope_type=rope.type,
                rope_params=dict(rope.params),
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                attention_bias=qkv_bias or attention_bias,
                output_bias=attention_bias and not qkv_bias,
                qk_norm=model_type == "qwen3",
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
                               "sliding_window": 4096},
            "qwen2": {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                      "tie_word_embeddings": True},
            "qwen3": qwen3,
            "qwen3_bias_yarn": {**qwen3, "attention_bias": True, "rope_scaling": {
                "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}},
        }

    def weight_shapes(self, shape: LlamaArchConfig) -> dict[str, tuple[int, ...]]:
        from fd_core.model.llama import weight_shapes

        return weight_shapes(shape)

    def build(self, shape: LlamaArchConfig, weights: Mapping[str, Any], *, kernels: Any,
              precision: ModelPrecision) -> Any:
        from fd_core.model.llama import LlamaForCausalLM

        return LlamaForCausalLM(shape, weights, dtype=precision.dtype, kernels=kernels,
                                linear_weights=precision.linear_weights, linear_inputs=precision.linear_inputs,
                                attention_inputs=precision.attention_inputs)


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


def _sliding_window(config: Mapping[str, Any], architecture: str) -> int | None:
    """The attention window of the layers that have one, or None: every layer attends to all."""
    window = config.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return window
    layer_types = config.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types) - {"full_attention"}
        if kinds - {"sliding_attention"}:
            raise ArchitectureConfigError("layer_types", f"{sorted(kinds)} are not attention kinds this plugin runs")
        return window if kinds else None
    return window if config.get("use_sliding_window", False) else None
