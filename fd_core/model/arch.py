"""The shape of a decoder-only Llama-family model, independent of where its weights come from.

The Llama-family plugin (``fd_plugins.models.llama``) parses Hugging Face configs and GGUF
metadata into a :class:`LlamaArchConfig`; the loaders produce a dict of float32 numpy weights
keyed by Hugging Face tensor names, and the Paddle model consumes exactly that, so a loader and
the model never need to know about each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from fd_core.model.rope import FREQ_FACTORS, RopeScaling

#: RoPE settings a GGUF file holds as tensors, not metadata: RoPE type -> setting -> the weight's name
#: (``fd_core.model.gguf_loader`` gives llama.cpp's ``rope_freqs`` and Phi-3's ``rope_factors_long`` /
#: ``rope_factors_short`` these names). Each is ``[rotary_dim / 2]``.
ROPE_TENSORS: Final[dict[str, dict[str, str]]] = {
    FREQ_FACTORS: {"factors": "model.rope_freqs.weight"},
    "longrope": {"short_factor": "model.rope_factors_short.weight", "long_factor": "model.rope_factors_long.weight"},
}


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The experts of a MoE layer and how tokens are routed to them."""

    num_experts: int
    top_k: int
    intermediate_size: int          # each expert's
    renormalize: bool               # the top-k weights are divided by their sum
    norm_min: float = 0.0           # ... clamped below at this (ERNIE: 1e-12)
    score_correction: bool = False  # ERNIE: ranks by softmax + e_score_correction_bias
    shared_intermediate_size: int = 0  # shared experts' MLP (0: none)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    def weight_shapes(self, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the layer's MoE tensors (Hugging Face names under ``prefix`` = ``...mlp.``)."""
        shapes: dict[str, tuple[int, ...]] = {f"{prefix}gate.weight": (self.num_experts, hidden)}
        for e in range(self.num_experts):
            shapes |= {f"{prefix}experts.{e}.gate_proj.weight": (self.intermediate_size, hidden),
                       f"{prefix}experts.{e}.up_proj.weight": (self.intermediate_size, hidden),
                       f"{prefix}experts.{e}.down_proj.weight": (hidden, self.intermediate_size)}
        if self.score_correction:
            shapes[f"{prefix}moe_statics.e_score_correction_bias"] = (1, self.num_experts)
        if self.shared_intermediate_size:
            size = self.shared_intermediate_size
            shapes |= {f"{prefix}shared_experts.gate_proj.weight": (size, hidden),
                       f"{prefix}shared_experts.up_proj.weight": (size, hidden),
                       f"{prefix}shared_experts.down_proj.weight": (hidden, size)}
        return shapes


@dataclass(frozen=True, slots=True)
class LlamaArchConfig:
    """Hyper-parameters of a Llama / SmolLM2 / Qwen2 shaped model.

    Weight names follow Hugging Face: ``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias`` for q/k/v when
    ``attention_bias``), ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (absent when ``tie_word_embeddings``), with ``qk_norm``
    ``model.layers.{i}.self_attn.{q,k}_norm.weight`` (``[head_dim]``, Qwen3), and a GGUF's RoPE tensors
    (:attr:`rope_tensors`). Linear weights are
    ``[out, in]``. ``max_position_embeddings`` is the context the model serves (see
    :meth:`~fd_core.model.rope.RopeScaling.context_length`).
    """

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    output_bias: bool = False     # o_proj has a bias too (Llama / Qwen3 with attention_bias)
    qk_norm: bool = False         # Qwen3: per-head RMSNorm of queries and keys before RoPE
    rope_type: str = "default"    # a type of fd_core.model.rope.KEYS, its settings in rope_params
    rope_params: Mapping[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions RoPE rotates (Phi-4-mini: 0.75)
    interleaved_rope: bool = False  # ERNIE 4.5: RoPE rotates pairs (2i, 2i+1), not halves (i, i + d/2)
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose attention has no position embedding
    embedding_multiplier: float = 1.0     # Granite: scales the embedded tokens
    attention_multiplier: float | None = None  # Granite: replaces attention's 1/sqrt(head_dim)
    residual_multiplier: float = 1.0      # Granite: scales each sublayer's output before its residual add
    logits_scaling: float = 1.0           # Granite: divides the logits
    hidden_act: str = "silu"              # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_weight_offset: float = 0.0       # Gemma: RMSNorm multiplies by (offset + weight)
    sandwich_norms: bool = False          # Gemma: attention and MLP outputs normed too (see fd_core.model.llama)
    sliding_window: int | None = None     # the window of the layers in sliding_layers
    sliding_layers: tuple[int, ...] = ()  # layers whose queries see only the last sliding_window keys
    local_rope_theta: float | None = None  # Gemma: the RoPE base of the sliding layers (default RoPE)
    final_logit_softcapping: float | None = None  # logits -> tanh(logits / c) * c
    moe: MoeShape | None = None           # the experts of the layers in moe_layers (Qwen3-MoE, ERNIE 4.5 MoE)
    moe_layers: tuple[int, ...] = ()      # layers whose MLP is a mixture of experts
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers are given without a moe shape")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def rope(self) -> RopeScaling:
        """The rotary embedding's base and scaling."""
        return RopeScaling(self.rope_theta, self.rope_type, self.rope_params, self.partial_rotary_factor)

    @property
    def rope_tensors(self) -> dict[str, str]:
        """The RoPE settings this checkpoint holds as tensors (those of :data:`ROPE_TENSORS` that
        ``rope_params`` lacks): setting -> weight name. The model reads them into :attr:`rope`."""
        return {key: name for key, name in ROPE_TENSORS.get(self.rope_type, {}).items() if key not in self.rope_params}

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in float32."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4
