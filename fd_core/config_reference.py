"""Describe every configuration key from the pydantic models themselves (docs/config.md, --help)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fd_core.config import FdConfig


@dataclass(frozen=True, slots=True)
class KeyDoc:
    """One configuration key as the reference and ``fd-serve --help`` show it."""

    section: str       # e.g. "cache"
    key: str           # e.g. "block_size"; the flag is --cache.block_size
    type: str          # e.g. "int | None"
    default: str       # repr of the default, "—" for None
    description: str   # markdown (backticks for names)

    @property
    def flag(self) -> str:
        return f"--{self.section}.{self.key}"


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return repr(field.default_factory())
    value = field.default
    return "—" if value is None else repr(value)


def _type(field: Any) -> str:
    """The key's type in words a user writes, never a library's module path (which moves between
    releases)."""
    return (str(field.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
            .replace("pydantic.types.ByteSize", "int | str (bytes)")
            .replace("pydantic.types.SecretStr", "str (secret)"))


def sections() -> Iterator[tuple[str, str]]:
    """(section name, first line of its docstring), in the order of :class:`FdConfig`."""
    for name, section in FdConfig.model_fields.items():
        model: type[BaseModel] = section.annotation
        yield name, (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""


def config_keys(section: str | None = None) -> Iterator[KeyDoc]:
    """Every key of every section (or of one), in declaration order."""
    for name, field in FdConfig.model_fields.items():
        if section is None or name == section:
            model: type[BaseModel] = field.annotation
            for key, sub in model.model_fields.items():
                yield KeyDoc(name, key, _type(sub), _default(sub), sub.description or "")


def render() -> str:
    """Markdown tables: one per section, a row per key with type, default and description."""
    lines = ["# Configuration reference", "",
             "Generated from `fd_core/config.py` by `python -m fd_core.config_reference > docs/config.md`.",
             "Every key can be set in the TOML file (`[section] key = ...`), as an environment variable",
             "(`FD_SECTION__KEY`) or as a CLI flag (`--section.key`); CLI > env > file > defaults.",
             "A seam's `options` table is validated by the selected plugin's own settings model.", ""]
    for name, doc in sections():
        lines += [f"## `[{name}]`", "", doc, "", "| key | type | default | description |", "|---|---|---|---|"]
        for item in config_keys(name):
            cells = [item.type.replace("|", "\\|"), item.default, item.description.replace("|", "\\|")]
            lines.append(f"| `{item.key}` | `{cells[0]}` | `{cells[1]}` | {cells[2]} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
