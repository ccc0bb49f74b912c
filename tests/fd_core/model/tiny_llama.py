"""Test helpers for model tests: tiny random Llama-family models and a greedy sampler."""

from __future__ import annotations

import numpy as np

from fd_core.model.arch import LlamaArchConfig
from fd_core.outputs import SampledToken
from fd_core.request import Request


def tiny_arch(*, tie: bool = False, bias: bool = False, layers: int = 3,
              rope_theta: float = 50000.0, head_dim: int = 16) -> LlamaArchConfig:
    """A Llama (or Qwen2, with ``bias``) shape small enough to run in milliseconds."""
    return LlamaArchConfig(
        architecture="Qwen2ForCausalLM" if bias else "LlamaForCausalLM",
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=rope_theta, tie_word_embeddings=tie, attention_bias=bias,
    )


def random_weights(arch: LlamaArchConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named float32 weights, far from uniform so greedy choices are clear-cut.

    Embeddings are N(0, 1); linears N(0, 1/in) scaled by 1.5 for q/k and by 3 for lm_head
    and for o/down (so layers outweigh the embedding and tied models do not just echo input).
    """
    rng = np.random.default_rng(seed)
    h, d = arch.hidden_size, arch.head_dim

    def linear(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((arch.vocab_size, h)).astype(np.float32),
         "model.norm.weight": norm(h)}
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = linear(arch.vocab_size, h, 3.0)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(arch.num_attention_heads * d, h, 1.5)
        w[p + "self_attn.k_proj.weight"] = linear(arch.num_key_value_heads * d, h, 1.5)
        w[p + "self_attn.v_proj.weight"] = linear(arch.num_key_value_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, arch.num_attention_heads * d, 3.0)
        w[p + "mlp.gate_proj.weight"] = linear(arch.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = linear(arch.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = linear(h, arch.intermediate_size, 3.0)
        if arch.attention_bias:
            for name, n in (("q", arch.num_attention_heads), ("k", arch.num_key_value_heads),
                            ("v", arch.num_key_value_heads)):
                bias = 0.5 * rng.standard_normal(n * d)
                w[p + f"self_attn.{name}_proj.bias"] = bias.astype(np.float32)
    return w


class GreedySampler:
    """Argmax sampler recording every logits row it sees, per request."""

    def __init__(self) -> None:
        self.logits: dict[str, list[np.ndarray]] = {}
        self.forgotten: list[str] = []

    def sample(self, logits, requests: list[Request]) -> list[SampledToken]:
        rows = logits.numpy()
        assert rows.shape[0] == len(requests)
        for row, req in zip(rows, requests, strict=True):
            self.logits.setdefault(req.request_id, []).append(row)
        return [SampledToken(token_id=int(row.argmax())) for row in rows]

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)
