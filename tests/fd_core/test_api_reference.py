"""docs/api.md is generated from fd_core's public surface and must match the code."""

from __future__ import annotations

from pathlib import Path

import fd_core
from fd_core.api_reference import render


def test_docs_api_reference_is_up_to_date():
    committed = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    assert committed == render(), "regenerate: python -m fd_core.api_reference > docs/api.md"


def test_every_public_name_is_documented():
    text = render()
    for name in fd_core.__all__:
        if name != "__version__":
            assert f"### `{name}" in text, name
            assert getattr(fd_core, name).__doc__, f"{name} has no docstring"
