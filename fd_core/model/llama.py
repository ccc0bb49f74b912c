"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) as Paddle compute over a paged KV cache.

Built from a :class:`~fd_core.model.arch.LlamaArchConfig` and Hugging Face named numpy
weights. Where the kernel set has a fused decoder layer, the layers are one kernel call;
otherwise, to keep per-layer Python overhead low, q/k/v are one matmul (their weights
concatenated), gate/up are one matmul feeding the ``swiglu`` kernel, residual adds are folded into the
RMSNorm kernel, and RoPE (Hugging Face's non-interleaved ``rotate_half`` convention) and the
K/V cache write are one kernel. The swappable ops (RMSNorm, RoPE + KV write, paged attention, SwiGLU)
come in a :class:`~fd_core.model.kernels.KernelSet` chosen from the platform's capabilities;
without one the model uses the portable kernels. Matrices may come block-quantized
(:class:`~fd_kernels.quantized.BlockQuantized`, from a GGUF): the linear kernel then keeps them
in their blocks (a float32 model) and the embedding lookup reads a float32 copy. With
``linear_weights="bfloat16"`` the other float32 matrices (projections and head) are rounded to
bfloat16, which the C++ linear kernel stores in 16 bits (inputs and sums stay float32; with
``linear_inputs="bfloat16"`` the inputs are rounded too, multiplied on AMX tiles where the CPU has them).
``attention_inputs="bfloat16"`` rounds attention's queries (for a bfloat16 cache: AMX tiles again).
``linear_inputs="int8"`` quantizes the inputs of the matrices kept in blocks to int8 blocks of 32
(the C++ kernel's integer dot products); with ``linear_weights="int8"`` the other float32 matrices
are int8 per output channel and their inputs uint8 per row (MKL's integer GEMM in C++).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fd_core.model.kernels import PORTABLE_KERNELS
from fd_core.model.moe import MoeWeights, moe_forward, prepare_moe
from fd_core.model.rope import RopeScaling, rope_tables, rotation_order
from fd_kernels.quantized import BlockQuantized, stack_rows

if TYPE_CHECKING:
    from fd_core.model.arch import LlamaArchConfig
    from fd_core.model.kernels import KernelSet
    from fd_core.runner.attention_metadata import AttentionMetadata
    from fd_core.runner.kv_cache import LayerKVCache

#: Compute dtypes the model accepts (the platform says which it runs); float32 is the tested path.
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
#: What ``attention_inputs`` may be: kept in float32 or rounded to bfloat16; ``linear_weights`` and
#: ``linear_inputs`` may also be int8 (inputs: for block-quantized matrices or int8 weights).
ROUNDINGS: tuple[str, ...] = ("float32", "bfloat16")
LINEAR_INPUTS: tuple[str, ...] = (*ROUNDINGS, "int8")
#: Rows of one MLP chunk in steps with more (see LlamaForCausalLM._mlp).
MLP_ROWS = 512


@dataclass(frozen=True, slots=True)
class _LayerWeights:
    """One decoder layer's tensors; linear weights are ``[in, out]`` (paddle's convention), as the
    kernel set's ``linear.prepare`` returned them."""

    input_norm: paddle.Tensor       # [hidden]
    qkv: Any                        # [hidden, (H + 2 * Hkv) * head_dim]: q (pre-scaled), k, v
    qkv_bias: paddle.Tensor | None  # [(H + 2 * Hkv) * head_dim] when attention_bias, same order
    qk_norms: tuple[paddle.Tensor, paddle.Tensor] | None  # [head_dim] each when qk_norm (q's pre-scaled)
    o: Any                          # [H * head_dim, hidden]
    o_bias: paddle.Tensor | None    # [hidden] when output_bias
    attn_out_norm: paddle.Tensor | None  # [hidden]: sandwich norms' norm of the attention output
    post_norm: paddle.Tensor        # [hidden]: the norm before the MLP
    mlp_out_norm: paddle.Tensor | None   # [hidden]: sandwich norms' norm of the MLP output
    gate_up: Any                    # [hidden, 2 * intermediate]: gate, then up columns (None in a MoE layer)
    down: Any                       # [intermediate, hidden] (None in a MoE layer)
    moe: MoeWeights | None          # the layer's experts, in place of gate_up / down
    window: int | None              # sliding-window attention: a query sees its last `window` keys
    rope: str                       # the rotation its K/V are written with: "global", "local" or "none"
    fused: Any                      # the fused layer kernel's operands, or None: run op by op


@dataclass(frozen=True, slots=True)
class LayerRun:
    """Layers ``[start, stop)``: bound together by the fused layer kernel (``fused``, one call for
    steps of fewer than its ``max_tokens`` tokens), or ``fused`` None: op by op."""

    start: int
    stop: int
    fused: Any


def layer_runs(layers: Sequence[_LayerWeights], fused_kernel: Any) -> list[LayerRun]:
    """The layers as maximal runs of bound (``layer.fused`` set) and unbound layers, in order."""
    runs: list[LayerRun] = []
    start = 0
    for stop in range(1, len(layers) + 1):
        if stop < len(layers) and (layers[stop].fused is None) == (layers[start].fused is None):
            continue
        bound = layers[start:stop]
        fused = (fused_kernel.join([layer.fused for layer in bound],
                                   [(layer.input_norm, layer.post_norm) for layer in bound])
                 if bound[0].fused is not None else None)
        runs.append(LayerRun(start, stop, fused))
        start = stop
    return runs


class LlamaForCausalLM:
    """A Llama-shaped causal LM whose attention reads and writes a paged KV cache."""

    def __init__(self, arch: LlamaArchConfig, weights: Mapping[str, np.ndarray | BlockQuantized], *,
                 dtype: str = "float32", kernels: KernelSet = PORTABLE_KERNELS,
                 linear_weights: str = "float32", linear_inputs: str = "float32",
                 attention_inputs: str = "float32") -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"model dtype {dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        for name, value, allowed in (("linear_weights", linear_weights, LINEAR_INPUTS),
                                     ("linear_inputs", linear_inputs, LINEAR_INPUTS),
                                     ("attention_inputs", attention_inputs, ROUNDINGS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not supported; use one of {allowed}")
        if linear_inputs == "bfloat16" and linear_weights != "bfloat16":
            raise ValueError("linear_inputs 'bfloat16' needs linear_weights 'bfloat16'")
        if linear_weights == "int8" and linear_inputs != "int8":
            raise ValueError("linear_weights 'int8' needs linear_inputs 'int8'")
        self.round_queries = attention_inputs == "bfloat16"
        rounding = {"bfloat16": linear_weights == "bfloat16", "bfloat16_inputs": linear_inputs == "bfloat16",
                    "int8": linear_weights == "int8"}
        int8_inputs = linear_inputs == "int8"
        expected = weight_shapes(arch)
        missing = [name for name in expected if name not in weights]
        if missing:
            raise ValueError(f"{len(missing)} weights missing for {arch.architecture}, "
                             f"e.g. {missing[:3]}")
        wrong = [f"{name}: {tuple(weights[name].shape)} != {shape}"
                 for name, shape in expected.items() if tuple(weights[name].shape) != shape]
        if wrong:
            raise ValueError(f"{len(wrong)} weights have the wrong shape for the config, "
                             f"e.g. {wrong[:3]}")
        self.arch = arch
        self.dtype = dtype
        self.kernels = kernels
        # Attention's 1/sqrt(head_dim) is folded into q_proj (RoPE is linear, so it commutes), or with
        # qk_norm into q_norm's weight (the norm would undo a scale before it); Granite's residual
        # multiplier into o_proj and down_proj, its logits scaling into the final norm.
        q_scale = arch.attention_multiplier or 1.0 / math.sqrt(arch.head_dim)
        q_proj_scale = 1.0 if arch.qk_norm else q_scale
        out_scale = arch.residual_multiplier
        # Interleaved or partial RoPE is the kernels' kind on q/k rows reordered per head (see rotation_order).
        head_order = rotation_order(arch.rope, arch.head_dim, interleaved=arch.interleaved_rope)

        def rope_rows(weight: np.ndarray | BlockQuantized, heads: int) -> np.ndarray | BlockQuantized:
            if head_order is None:
                return weight
            order = (np.arange(heads)[:, None] * arch.head_dim + head_order[None, :]).reshape(-1)
            return weight.take_rows(order) if isinstance(weight, BlockQuantized) else weight[order]

        def tensor(array: np.ndarray | BlockQuantized) -> paddle.Tensor:
            if isinstance(array, BlockQuantized):
                array = array.dequantize()
            return paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32), dtype=dtype)

        def keeps_blocks(*blocks: np.ndarray | BlockQuantized) -> bool:  # the kernel reads float32 rows
            return dtype == "float32" and all(isinstance(b, BlockQuantized) for b in blocks)

        def linear(*blocks: np.ndarray | BlockQuantized) -> Any:  # HF [out, in] blocks, prepared
            if keeps_blocks(*blocks):
                return kernels.linear.prepare(stack_rows(list(blocks)), int8_inputs=int8_inputs)
            dense = [b.dequantize() if isinstance(b, BlockQuantized) else b for b in blocks]
            return kernels.linear.prepare(tensor(np.concatenate(dense, axis=0).T), **rounding)  # [in, sum(out)]

        def scaled(weight: np.ndarray | BlockQuantized, factor: float) -> np.ndarray | BlockQuantized:
            return weight.scaled(factor) if isinstance(weight, BlockQuantized) else weight * factor

        def norm(name: str) -> np.ndarray:   # an RMSNorm weight as it multiplies (Gemma's 1 + w)
            return weights[name] + np.float32(arch.norm_weight_offset)

        embedding = weights["model.embed_tokens.weight"]
        self.embed_tokens = tensor(embedding)     # [vocab, hidden]
        self.layers: list[_LayerWeights] = []
        for i in range(arch.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (f"{p}self_attn.{x}_proj" for x in "qkv")
            heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
            qkv = linear(scaled(rope_rows(weights[f"{q}.weight"], heads), q_proj_scale),
                         rope_rows(weights[f"{k}.weight"], kv_heads), weights[f"{v}.weight"])
            qkv_bias = (tensor(np.concatenate([rope_rows(weights[f"{q}.bias"], heads) * q_proj_scale,
                                               rope_rows(weights[f"{k}.bias"], kv_heads), weights[f"{v}.bias"]]))
                        if arch.attention_bias else None)
            qk_norms = ((tensor(rope_rows(norm(f"{p}self_attn.q_norm.weight"), 1) * q_scale),
                         tensor(rope_rows(norm(f"{p}self_attn.k_norm.weight"), 1))) if arch.qk_norm else None)
            o = linear(scaled(weights[f"{p}self_attn.o_proj.weight"], out_scale))
            o_bias = tensor(weights[f"{p}self_attn.o_proj.bias"] * out_scale) if arch.output_bias else None
            window = arch.sliding_window if i in arch.sliding_layers else None
            rope = "none" if i in arch.no_rope_layers else "local" if window and arch.local_rope_theta else "global"
            # the fused layer kernel has no o_proj bias, other rotation, window, shared experts, sandwich
            # norms or GeGLU: such layers run op by op (q/k norms and routed experts it runs)
            fusable = (o_bias is None and rope == "global" and window is None
                       and not (i in arch.moe_layers and arch.moe.shared_intermediate_size)
                       and not arch.sandwich_norms and arch.hidden_act == "silu")
            if i in arch.moe_layers:   # experts instead of the dense MLP
                moe, gate_up, down = prepare_moe(arch.moe, f"{p}mlp.", weights, tensor, linear,
                                                   kernels.moe_experts.bind), None, None
            else:
                moe = None
                gate_up = linear(weights[f"{p}mlp.gate_proj.weight"], weights[f"{p}mlp.up_proj.weight"])
                down = linear(scaled(weights[f"{p}mlp.down_proj.weight"], out_scale))
            # Gemma's sandwich: post_attention_layernorm norms the attention output, pre_feedforward_layernorm
            # is the norm before the MLP
            sandwich = arch.sandwich_norms
            self.layers.append(_LayerWeights(
                input_norm=tensor(norm(f"{p}input_layernorm.weight")), qkv=qkv, qkv_bias=qkv_bias,
                qk_norms=qk_norms, o=o, o_bias=o_bias,
                attn_out_norm=tensor(norm(f"{p}post_attention_layernorm.weight")) if sandwich else None,
                post_norm=tensor(norm(f"{p}pre_feedforward_layernorm.weight" if sandwich
                                      else f"{p}post_attention_layernorm.weight")),
                mlp_out_norm=tensor(norm(f"{p}post_feedforward_layernorm.weight")) if sandwich else None,
                gate_up=gate_up, down=down, moe=moe, window=window, rope=rope,
                fused=(kernels.decoder_layer.bind([qkv, o, gate_up, down], qkv_bias, qk_norms,
                                                  *((moe.experts, moe.bound) if moe is not None else ()))
                       if fusable else None),
            ))
        self.runs = layer_runs(self.layers, kernels.decoder_layer)
        self.norm = tensor(norm("model.norm.weight") / np.float32(arch.logits_scaling))
        # [vocab, hidden], applied transposed (a tied head reads the embedding).
        head = embedding if arch.tie_word_embeddings else weights["lm_head.weight"]
        if keeps_blocks(head):
            self.lm_head = kernels.linear.prepare(head, int8_inputs=int8_inputs)
        else:
            self.lm_head = kernels.linear.prepare(self.embed_tokens if arch.tie_word_embeddings else tensor(head),
                                                  transposed=True, **rounding)
        rope = arch.rope   # with the settings a GGUF holds as tensors (llama.cpp's rope_freqs, Phi-3's factors)
        rope = RopeScaling(rope.theta, rope.type, {**rope.params, **{key: weights[name] for key, name
                                                                     in arch.rope_tensors.items()}},
                           rope.partial_rotary_factor)
        cos, sin = rope_tables(rope, arch.head_dim, arch.max_position_embeddings)
        self.rope_cos = tensor(cos)
        self.rope_sin = tensor(sin)
        # cos / sin per rotation a layer uses: layers without RoPE write K/V through the same kernel with
        # the identity rotation; Gemma's sliding layers have their own base
        self.rotations: dict[str, tuple[paddle.Tensor, paddle.Tensor]] = {"global": (self.rope_cos, self.rope_sin)}
        kinds = {layer.rope for layer in self.layers}
        if "none" in kinds:
            self.rotations["none"] = (tensor(np.ones_like(cos)), tensor(np.zeros_like(sin)))
        if "local" in kinds:
            local = rope_tables(RopeScaling(arch.local_rope_theta), arch.head_dim, arch.max_position_embeddings)
            self.rotations["local"] = (tensor(local[0]), tensor(local[1]))

    def _mlp(self, h: paddle.Tensor, layer: _LayerWeights) -> paddle.Tensor:
        """down(swiglu(gate_up(h))), in chunks of MLP_ROWS rows: a chunk's gate/up activations
        (rows x 2 x intermediate floats) stay in the CPU's cache on their way into SwiGLU instead
        of a whole prefill step's going out to memory and back. A MoE layer runs its experts."""
        if layer.moe is not None:
            return moe_forward(h, layer.moe, self.kernels)
        linear = self.kernels.linear
        activation = self.kernels.swiglu if self.arch.hidden_act == "silu" else self.kernels.geglu
        rows = h.shape[0]
        if rows <= MLP_ROWS:
            return linear(activation(linear(h, layer.gate_up)), layer.down)
        return paddle.concat([linear(activation(linear(h[at:at + MLP_ROWS], layer.gate_up)), layer.down)
                              for at in range(0, rows, MLP_ROWS)])

    def _norm(self, x: paddle.Tensor, weight: paddle.Tensor,
              residual: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """RMSNorm of ``x + residual``; returns (normed, the new residual stream)."""
        return self.kernels.rms_norm(x, weight, self.arch.rms_norm_eps, residual)

    def _qk_norm(self, qkv: paddle.Tensor, q_norm: paddle.Tensor, k_norm: paddle.Tensor) -> paddle.Tensor:
        """RMSNorm of each query and key head (Qwen3), values untouched: ``qkv [T, H + 2 Hkv, D]``."""
        heads, kv_heads, head_dim = self.arch.num_attention_heads, self.arch.num_key_value_heads, self.arch.head_dim
        q, k, v = paddle.split(qkv, [heads, kv_heads, kv_heads], axis=1)
        eps = self.arch.rms_norm_eps
        q, _ = self.kernels.rms_norm(q.reshape([-1, head_dim]), q_norm, eps, None)
        k, _ = self.kernels.rms_norm(k.reshape([-1, head_dim]), k_norm, eps, None)
        return paddle.concat([q.reshape([-1, heads, head_dim]), k.reshape([-1, kv_heads, head_dim]), v], axis=1)

    def _layer(self, x: paddle.Tensor, residual: paddle.Tensor | None, layer: _LayerWeights, cache: LayerKVCache,
               attn: AttentionMetadata, rope_write_kv: Any) -> tuple[paddle.Tensor, paddle.Tensor]:
        """One decoder layer op by op: ``(out, residual stream)``, its K/V written into ``cache``."""
        num_tokens, heads, head_dim = x.shape[0], self.arch.num_attention_heads, self.arch.head_dim
        linear = self.kernels.linear
        h, residual = self._norm(x, layer.input_norm, residual)
        qkv = linear(h, layer.qkv, layer.qkv_bias).reshape([num_tokens, -1, head_dim])
        if layer.qk_norms is not None:
            qkv = self._qk_norm(qkv, *layer.qk_norms)
        q = rope_write_kv(qkv, cache.key, cache.value)
        windowed = {"window": layer.window} if layer.window else {}
        out = self.kernels.attention(q, cache.key, cache.value, attn, round_queries=self.round_queries, **windowed)
        out = linear(out.reshape([num_tokens, heads * head_dim]), layer.o, layer.o_bias)
        if layer.attn_out_norm is not None:
            out, _ = self.kernels.rms_norm(out, layer.attn_out_norm, self.arch.rms_norm_eps, None)
        h, residual = self._norm(out, layer.post_norm, residual)
        out = self._mlp(h, layer)
        if layer.mlp_out_norm is not None:
            out, _ = self.kernels.rms_norm(out, layer.mlp_out_norm, self.arch.rms_norm_eps, None)
        return out, residual

    def forward(self, input_ids: paddle.Tensor, attn: AttentionMetadata,
                kv_caches: Sequence[LayerKVCache]) -> paddle.Tensor:
        """Run ``input_ids [T]`` at ``attn``'s positions, writing their K/V into ``kv_caches``.

        Returns float32 logits ``[S, vocab]`` for the tokens at ``attn.sample_indices`` only.
        """
        arch = self.arch
        heads, head_dim = arch.num_attention_heads, arch.head_dim
        num_tokens = input_ids.shape[0]
        writers = {kind: self.kernels.rope_write_kv(cos, sin, attn, heads)
                   for kind, (cos, sin) in self.rotations.items()}
        linear = self.kernels.linear
        fused_layer = self.kernels.decoder_layer
        x = F.embedding(input_ids, self.embed_tokens)
        if arch.embedding_multiplier != 1.0:
            x = x * arch.embedding_multiplier
        residual = None
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        for run in self.runs:
            caches = kv_caches[run.start:run.stop]
            if run.fused is not None and num_tokens < run.fused.max_tokens:
                x, residual = fused_layer(run.fused, x, residual, [c.key for c in caches], [c.value for c in caches],
                                          attn, self.rope_cos, self.rope_sin, heads, head_dim, arch.rms_norm_eps,
                                          round_queries=self.round_queries)
                continue
            for layer, cache in zip(self.layers[run.start:run.stop], caches, strict=True):
                x, residual = self._layer(x, residual, layer, cache, attn, writers[layer.rope])
        if attn.sample_indices.shape[0] == 0:
            return paddle.zeros([0, arch.vocab_size], dtype="float32")
        # Only the tokens whose logits are asked for (sampled rows, prompt logprobs) need the final
        # norm and the (large) vocabulary projection.
        h, _ = self._norm(paddle.gather(x, attn.sample_indices), self.norm,
                          paddle.gather(residual, attn.sample_indices))
        logits = linear(h, self.lm_head)
        logits = logits if self.dtype == "float32" else logits.astype("float32")
        if arch.final_logit_softcapping:
            logits = paddle.tanh(logits / arch.final_logit_softcapping) * arch.final_logit_softcapping
        return logits

    __call__ = forward


def weight_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight a model of ``arch`` has (layout documented in arch.py)."""
    h, q, kv = (
        arch.hidden_size,
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for name in arch.rope_tensors.values():
        shapes[name] = (arch.rope.rotary_dim(arch.head_dim) // 2,)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if arch.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if i in arch.moe_layers:
            shapes |= arch.moe.weight_shapes(p + "mlp.", h)
        else:
            shapes |= {p + "mlp.gate_proj.weight": (arch.intermediate_size, h),
                       p + "mlp.up_proj.weight": (arch.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, arch.intermediate_size)}
        if arch.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        if arch.output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if arch.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (arch.head_dim,), p + "self_attn.k_norm.weight": (arch.head_dim,)}
    return shapes
