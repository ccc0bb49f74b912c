"""Mixture-of-experts layers in the engine: a token's expert output does not depend on the tokens
beside it, batched and preempted runs decode what one-at-a-time runs do (through the C++ experts
op where the host has the C++ kernels), and every KV block is free after the drain (the parity
with transformers is the conformance kit's, test_llama_family; the op's own bits,
tests/fd_kernels/test_moe_experts.py)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core.engine.llm import LLM
from fd_core.model.arch import MoeShape
from fd_core.model.kernels import PORTABLE_KERNELS, select_kernels
from fd_core.model.moe import moe_forward, prepare_moe
from fd_core.request import SamplingParams
from fd_core.testing.tiny_model import make_tiny_checkpoint
from fd_kernels.native import ExpertOperands
from fd_plugins.platforms.cpu import CpuPlatform

HIDDEN = 64
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kernels", [PORTABLE_KERNELS, select_kernels(CpuPlatform().capabilities)],
                         ids=["portable", "host"])
def test_a_tokens_expert_output_is_the_same_alone_and_among_256(kernels) -> None:
    rng = np.random.default_rng(0)
    shape = MoeShape(8, 2, 96, renormalize=True, shared_intermediate_size=64, score_correction=True)
    weights = {name: rng.standard_normal(size).astype(np.float32) * 0.2
               for name, size in shape.weight_shapes("mlp.", HIDDEN).items()}

    def tensor(array):
        return paddle.to_tensor(np.ascontiguousarray(array, np.float32))

    moe = prepare_moe(shape, "mlp.", weights, tensor, lambda *blocks: kernels.linear.prepare(
        tensor(np.concatenate(blocks, axis=0).T)), kernels.moe_experts.bind)
    x = rng.standard_normal((256, HIDDEN)).astype(np.float32)
    among = moe_forward(paddle.to_tensor(x), moe, kernels).numpy()
    for row in (0, 77, 255):
        alone = moe_forward(paddle.to_tensor(x[row:row + 1]), moe, kernels).numpy()[0]
        np.testing.assert_allclose(alone, among[row], rtol=1e-5, atol=1e-6)
    # against the definition: every token through its own top-k experts, one at a time
    probs = np.exp(x @ weights["mlp.gate.weight"].T)
    probs /= probs.sum(axis=1, keepdims=True)
    scores = probs + weights["mlp.moe_statics.e_score_correction_bias"][0]
    chosen = np.argsort(-scores, axis=1, kind="stable")[:, :2]

    def mlp(h, prefix):
        gate, up = h @ weights[f"{prefix}gate_proj.weight"].T, h @ weights[f"{prefix}up_proj.weight"].T
        return (gate / (1 + np.exp(-gate)) * up) @ weights[f"{prefix}down_proj.weight"].T

    for row in (0, 77, 255):
        mix = probs[row, chosen[row]] / probs[row, chosen[row]].sum()
        want = sum(w * mlp(x[row], f"mlp.experts.{e}.") for e, w in zip(chosen[row], mix, strict=True))
        np.testing.assert_allclose(among[row], want + mlp(x[row], "mlp.shared_experts."), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """A random Qwen3-MoE (experts in layers 1 and 2) with the tiny Llama's tokenizer."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
              "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [0]}
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-moe"), config, seed=7))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(5, 60))).tolist() for _ in range(n)]


def _all_free(llm: LLM) -> bool:
    stats = llm.engine.resource_manager.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_moe_batched_and_preempted_runs_decode_what_one_at_a_time_runs_do(tiny_moe: str, precision: str) -> None:
    prompts = _prompts(8, seed=3)
    model = {"source": tiny_moe, "precision": precision}
    with LLM(model=model, cache={"num_blocks": 256, "enable_prefix_caching": False},
             engine={"max_num_seqs": 1, "max_num_batched_tokens": 512}) as alone:
        reference = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    with LLM(model=model, cache={"num_blocks": 14, "block_size": 16, "enable_prefix_caching": False},
             engine={"max_num_seqs": 8, "max_num_batched_tokens": 128}) as tight:
        results = tight.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == reference
        if tight.engine.runner.kernels.chosen["moe_experts"].name == "cpp":   # the C++ op ran the experts
            assert isinstance(tight.engine.runner.model.layers[1].moe.bound, ExpertOperands)
        assert tight.engine.resource_manager.stats().num_preemptions > 0
        assert _all_free(tight)
