"""Write a random Llama as GGUF files that llama.cpp itself quantized (Q4_0, Q4_K_M...), for benchmarks.

The model (hidden 1024, 8 layers, intermediate 2816, 16/4 heads of 64, vocabulary 32000: every
matrix row a whole number of K-quant super-blocks), or the Hugging Face folder ``--source`` (e.g.
``benchmarks/moe_model.py``'s), is written as a float32 GGUF in llama.cpp's naming, then each
``--types`` file is made from it by ``llama_model_quantize`` of the llama-cpp-python in
``--llamacpp-venv``: llama.cpp's own choice of types per tensor (Q4_K_M: Q4_K matrices, Q6_K for
the head and half of the v / down projections). Weights are random: speed and memory only, no
text quality.

    python benchmarks/gguf_files.py /tmp/gguf-medium --llamacpp-venv /tmp/venv-llama --types Q4_0,Q4_K_M
    python benchmarks/single_sequence.py --model /tmp/gguf-medium/Q4_K_M.gguf --max-token-id 32000 \\
        --llamacpp-venv /tmp/venv-llama --fd 'keep={"model": {"quantized_weights": "keep"}}'
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False,
}

# Runs in the llama.cpp venv: quantize argv[1] into argv[2] as llama.cpp's file type argv[3].
_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = 0
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) != 0:
    sys.exit(f"llama_model_quantize failed for {sys.argv[3]}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--llamacpp-venv", type=Path, required=True)
    parser.add_argument("--types", default="Q4_0,Q4_K_M", help="llama.cpp file types (LLAMA_FTYPE_MOSTLY_*)")
    parser.add_argument("--source", type=Path, help="a Hugging Face folder to convert instead of the random Llama")
    args = parser.parse_args()
    from fd_core.testing.tiny_model import make_tiny_checkpoint, write_tiny_gguf

    args.folder.mkdir(parents=True, exist_ok=True)
    hf = args.source or make_tiny_checkpoint(args.folder / "hf", CONFIG, seed=0)
    source = write_tiny_gguf(args.folder / "F32.gguf", hf)
    print(f"wrote {source}: {source.stat().st_size / 2**20:.0f} MiB")
    for kind in args.types.split(","):
        out = args.folder / f"{kind}.gguf"
        subprocess.run([str(args.llamacpp_venv / "bin" / "python"), "-c", _QUANTIZE, str(source), str(out), kind],
                       check=True, capture_output=True)
        print(f"wrote {out}: {out.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
