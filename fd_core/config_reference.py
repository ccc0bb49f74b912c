"""Render the configuration reference (docs/config.md) from the pydantic models themselves."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from fd_core.config import FdConfig


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return repr(field.default_factory())
    value = field.default
    return "—" if value is None else repr(value)


def _type(field: Any) -> str:
    text = str(field.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("|", "\\|")


def render() -> str:
    """Markdown tables: one per section, a row per key with type, default and description."""
    lines = ["# Configuration reference", "",
             "Generated from `fd_core/config.py` by `python -m fd_core.config_reference > docs/config.md`.",
             "Every key can be set in the TOML file (`[section] key = ...`), as an environment variable",
             "(`FD_SECTION__KEY`) or as a CLI flag (`--section.key`); CLI > env > file > defaults.",
             "A seam's `options` table is validated by the selected plugin's own settings model.", ""]
    for name, section in FdConfig.model_fields.items():
        model: type[BaseModel] = section.annotation
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        lines += [f"## `[{name}]`", "", doc, "", "| key | type | default | description |", "|---|---|---|---|"]
        for key, field in model.model_fields.items():
            description = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{key}` | `{_type(field)}` | `{_default(field)}` | {description} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
