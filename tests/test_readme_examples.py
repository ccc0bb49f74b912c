"""The README's Python examples run as written (over a tiny model, chosen through the environment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fd_core.testing.tiny_model import make_tiny_llama

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)\n```", README.read_text(), re.S)


def test_the_readme_has_the_offline_and_the_asyncio_example():
    assert any("LLM()" in block for block in EXAMPLES)
    assert any("AsyncLLM.start()" in block for block in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_a_readme_example_runs(example: str, tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", layers=2, vocab=512, max_position_embeddings=256)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    env |= {"FD_MODEL__SOURCE": str(model), "FD_CACHE__NUM_BLOCKS": "64"}
    proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the example printed nothing"
