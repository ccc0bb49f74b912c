"""The shape of a decoder-only Llama-family model, independent of where its weights come from.

Both loaders (Hugging Face folders and GGUF files) produce a :class:`LlamaArchConfig` and a
dict of float32 numpy weights keyed by Hugging Face tensor names; the Paddle model consumes
exactly that, so a loader and the model never need to know about each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Hugging Face ``architectures`` entries the Llama-family model runs.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)


@dataclass(frozen=True, slots=True)
class LlamaArchConfig:
    """Hyper-parameters of a Llama / SmolLM2 / Qwen2 shaped model.

    Weight names follow Hugging Face: ``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias`` for q/k/v when
    ``attention_bias``), ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (absent when ``tie_word_embeddings``). Linear weights are ``[out, in]``.
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in float32."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4
