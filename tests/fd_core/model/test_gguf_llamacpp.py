"""llama.cpp as a second oracle for GGUF files: on the same file, its greedy continuation and
ours agree token for token at the top-1 (teacher-forced over llama.cpp's own continuation).

Runs where ``FD_LLAMACPP_PYTHON`` names a Python with ``llama-cpp-python`` installed (a 6-minute
build, so CI leaves it out): ``python -m venv /tmp/venv-llama && /tmp/venv-llama/bin/pip install
llama-cpp-python numpy``, then ``FD_LLAMACPP_PYTHON=/tmp/venv-llama/bin/python pytest this file``.
Each case prints its agreement; the closing note of the issue that added it reports them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fd_core.model.architectures import ArchitecturePlugins
from fd_core.model.gguf_loader import load_gguf
from fd_core.model.kernels import select_kernels
from fd_core.testing.conformance.architecture import greedy_decode
from fd_core.testing.tiny_model import make_tiny_checkpoint
from fd_plugins.platforms.cpu import CpuPlatform
from tests.fd_core.model.gguf_encoders import write_gguf
from tests.fd_core.model.test_gguf_architectures import CASES

LLAMACPP_PYTHON = os.environ.get("FD_LLAMACPP_PYTHON")
pytestmark = pytest.mark.skipif(not LLAMACPP_PYTHON, reason="FD_LLAMACPP_PYTHON names no llama-cpp-python")
NEW_TOKENS = 24
PROMPTS = [[5, 6, 7, 8] * 6, list(range(100, 140))]
#: Quantized files: llama.cpp multiplies their matrices by its own int8 blocks of the inputs (a
#: float16 scale per 32 for Q4 / Q8, a float32 one per 256 for K-quants) and sums in its own order,
#: so logits differ by ~1-2% of their range (measured: 0.8-2.0%) and positions whose two best
#: logits are closer than that may flip (tiny random models have many). A layout mistake moves
#: logits by a large part of their range.
MIN_AGREEMENT = 0.85
MAX_QUANTIZED_DIFFERENCE = 0.03

# Runs in the llama.cpp venv: greedy continuations of argv[2]'s prompts and each step's logits.
_LLAMACPP = """
import json, sys
import numpy as np
from llama_cpp import Llama
prompts, new_tokens = json.loads(sys.argv[2]), int(sys.argv[3])
# a context within every test model's pre-trained window: llama.cpp then picks Phi-3's short factors, as we do
# and a float32 KV cache, as ours (llama.cpp's default is float16)
llm = Llama(model_path=sys.argv[1], n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
out = []
for prompt in prompts:
    llm.reset()
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(new_tokens):
        logits.append(llm.scores[llm.n_tokens - 1].tolist())
        tokens.append(int(np.argmax(logits[-1])))
        llm.eval([tokens[-1]])
    out.append((tokens, logits))
print(json.dumps(out))
"""

BASE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
ARCHITECTURES = {
    "llama": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64},
}
#: (tensor type of the matrices, overrides): a Q4_K_M-like mix among them
QUANTS = {
    "Q8_0": ("Q8_0", {}),
    "Q4_0": ("Q4_0", {"output.weight": "Q6_K"}),
    "Q4_K_M": ("Q4_K", {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"}),
    "Q5_K": ("Q5_K", {}),
}


def _llamacpp_greedy(path: Path) -> tuple[list[list[int]], list[np.ndarray]]:
    """llama.cpp's greedy tokens of each prompt and its logits ``[NEW_TOKENS, vocab]`` before each."""
    proc = subprocess.run([LLAMACPP_PYTHON, "-c", _LLAMACPP, str(path), json.dumps(PROMPTS), str(NEW_TOKENS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return [tokens for tokens, _ in out], [np.array(logits, np.float32) for _, logits in out]


def _compare(path: Path, **runner_options: str) -> tuple[float, float]:
    """Top-1 agreement of our logits with llama.cpp's greedy tokens, and the largest difference of
    the two logits (relative to their range), teacher-forced over llama.cpp's continuation."""
    theirs, their_logits = _llamacpp_greedy(path)
    arch, weights, metadata = load_gguf(path, keep_quantized=True)
    plugin = ArchitecturePlugins().for_gguf(metadata["general.architecture"], str(path))
    kernels = select_kernels(CpuPlatform().capabilities)
    _, logits = greedy_decode(plugin, arch, weights, PROMPTS, NEW_TOKENS, kernels=kernels, forced=theirs,
                              **runner_options)
    ours, want = np.concatenate(logits), np.concatenate(their_logits)
    agreement = float(np.mean(np.argmax(ours, axis=-1) == np.concatenate(theirs)))
    return agreement, float(np.abs(ours - want).max() / np.ptp(want))


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("linear_inputs", ["float32", "int8"])
def test_llamacpp_agrees_with_our_greedy_tokens_on_the_same_file(tmp_path: Path, architecture: str, quant: str,
                                                                linear_inputs: str) -> None:
    """Quantized files, their blocks kept (float32 or int8 inputs)."""
    folder = make_tiny_checkpoint(tmp_path / "hf", ARCHITECTURES[architecture], seed=1)
    tensor_type, overrides = QUANTS[quant]
    path = write_gguf(tmp_path / f"{quant}.gguf", folder, tensor_type=tensor_type, tensor_types=overrides)
    agreement, difference = _compare(path, linear_inputs=linear_inputs)
    print(f"{architecture} {quant} inputs {linear_inputs}: top-1 agreement with llama.cpp {agreement:.3f}, "
          f"largest logit difference {difference:.2%} of the range")
    assert agreement >= MIN_AGREEMENT and difference < MAX_QUANTIZED_DIFFERENCE


#: The architecture cases llama.cpp reads as transformers does, in its terms: Phi-3's longrope with a
#: pre-trained window larger than llama.cpp's context (which it pads to 256; above the window it uses
#: the long factors for every position, where transformers switches by sequence length); Qwen3
#: without q/k/v biases (llama.cpp's qwen3 has none). Phi-3's sliding window is left out: llama.cpp
#: disables it ("Phi SWA is currently disabled", llama.cpp PR 13676); we follow transformers.
ORACLE_CASES = {
    **{case: config for case, (_, config) in CASES.items() if case != "phi3_window"},
    "phi3": {**CASES["phi3"][1], "original_max_position_embeddings": 4096, "max_position_embeddings": 16384},
    "qwen3_yarn": {**CASES["qwen3_yarn"][1], "attention_bias": False},
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_llamacpp_reads_each_architectures_file_as_we_do(tmp_path: Path, case: str) -> None:
    """Float32 files of every GGUF architecture the built-in plugin maps: llama.cpp, which defines
    these files, computes the logits we do."""
    folder = make_tiny_checkpoint(tmp_path / "hf", ORACLE_CASES[case], seed=3)
    agreement, difference = _compare(write_gguf(tmp_path / f"{case}.gguf", folder))
    print(f"{case} F32: top-1 agreement with llama.cpp {agreement:.3f}, largest logit difference "
          f"{difference:.2%} of the range")
    # ggml's CPU GELU reads a table of float16 inputs (GGML_GELU_FP16): Gemma's GeGLU differs by ~1e-3
    assert difference < (5e-3 if case.startswith("gemma3") else 1e-4)
    assert agreement == 1.0
