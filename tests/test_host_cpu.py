"""Run first (tests/conftest.py orders it): can this CPU run the model at all?

Many tests run the model in the pytest process itself; a kernel that executes an instruction
this CPU lacks would kill pytest with SIGILL and print nothing. This test runs one real forward
pass of a tiny model in a subprocess, with the kernels the cpu platform selects here. If it
dies, the test fails naming the signal, the CPU and the kernels, and the run stops.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fd_core.exit_status import describe_exit
from fd_core.model.kernels import select_kernels
from fd_core.testing.tiny_model import make_tiny_llama
from fd_plugins.platforms.cpu import CpuPlatform

#: The subprocess: build an engine over the tiny model (its warm-up is a forward pass), then
#: generate a few tokens through the whole engine.
FORWARD_PASS = """
import sys
from fd_core import LLM, SamplingParams
llm = LLM(sys.argv[1], cache={"num_blocks": 32})
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
assert len(out.token_ids) == 4, out
print("ok:", llm.engine.runner.kernels.describe())
"""


def test_a_forward_pass_runs_on_this_cpu(tmp_path: Path) -> None:
    platform = CpuPlatform()
    kernels = select_kernels(platform.capabilities).describe()
    model = make_tiny_llama(tmp_path / "tiny", layers=2, vocab=512, max_position_embeddings=128)
    proc = subprocess.run([sys.executable, "-c", FORWARD_PASS, str(model)],
                          capture_output=True, text=True, timeout=300)
    stack = [line.strip() for line in proc.stderr.splitlines() if line.strip().startswith("File ")]
    assert proc.returncode == 0, (
        f"a forward pass of a tiny model died on this CPU with {describe_exit(proc.returncode)}\n"
        f"CPU: {platform.features.describe()}\nkernels: {kernels}\n"
        f"innermost Python frames:\n  " + "\n  ".join(stack[:4]) + f"\nstderr tail:\n{proc.stderr[-2000:]}")
    assert proc.stdout.strip() == f"ok: {kernels}"
