"""Write a random Qwen3-MoE-shaped model big enough to matter (~1B parameters, float32) for benchmarks.

16 layers of hidden size 1024, 16 experts of 1024 each with 2 chosen per token, GQA 16/4 heads of
128; the tiny trained tokenizer. Weights are random: speed and memory only, no text quality.

    python benchmarks/moe_model.py /tmp/moe-1b
    python benchmarks/step_breakdown.py --kernels auto --rows 64 --prompt-len 128 \\
        --variant 'moe={"model": {"source": "/tmp/moe-1b"}}'
"""

from __future__ import annotations

import argparse
import sys

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "num_experts": 16, "num_experts_per_tok": 2,
    "moe_intermediate_size": 1024, "norm_topk_prob": True, "mlp_only_layers": [],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    args = parser.parse_args()
    from fd_core.testing.tiny_model import make_tiny_checkpoint

    folder = make_tiny_checkpoint(args.folder, CONFIG, seed=0)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"wrote {folder}: {size / 2**30:.2f} GiB of float32 weights ({size // 4 / 1e9:.2f} B parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
