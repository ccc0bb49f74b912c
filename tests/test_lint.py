"""The project follows its ruff configuration in pyproject.toml (line length, import order, rules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, f"ruff check failed (fix it, or `ruff check --fix`):\n{result.stdout}{result.stderr}"
