"""The docs' code runs: every ``python`` and ``toml`` block of README.md, docs/ and examples/,
and every hookspec documented in docs/plugins.md with its exact signature.

A block's kind is the HTML comment on the line before its fence (none: the default):

* ``python`` (default): a whole program, run in a fresh interpreter over a tiny model chosen
  through the environment (``FD_MODEL__SOURCE``); it must exit 0.
* ``<!-- doc: run-tests Name=module:attr ... -->``: a test module for a plugin author; ``Name`` is
  bound to the built-in of that seam, and every ``test_*`` function it defines is called.
* ``<!-- doc: fragment (why) -->``: part of a program (the reader's own classes, a server to
  talk to): it must compile, and its imports must work.
* ``toml`` (default): a deploy config; ``load_config`` accepts it.
* ``<!-- doc: router-config -->``: a router config; ``load_router_config`` accepts it.
* ``<!-- doc: pyproject -->``: a plugin package's entry points, in groups the core reads.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from fd_core import hookspecs
from fd_core.config import load_config
from fd_core.registry import GENERAL_GROUP, SEAM_GROUPS
from fd_core.router.config import load_router_config
from fd_core.testing.tiny_model import make_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
BLOCK = re.compile(r"(?:<!-- doc: ([\w-]+)([^>]*?)-->\n)?```(python|toml)\n(.*?)\n```", re.S)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    kind: str       # "" (the default of its language), "run-tests", "fragment" or "pyproject"
    argument: str   # what follows the kind in the marker
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            kind, argument, language, code = match.groups()
            found.append(Block(path, text.count("\n", 0, match.start(3)) + 1, language, kind or "",
                               (argument or "").strip(), code))
    return found


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.language == "python"]
TOML = [b for b in BLOCKS if b.language == "toml"]
KINDS = {"python": {"", "run-tests", "fragment"}, "toml": {"", "pyproject", "router-config"}}


def test_every_block_has_a_known_kind():
    assert len(PYTHON) >= 8 and len(TOML) >= 8
    unknown = [(b.id, b.kind) for b in BLOCKS if b.kind not in KINDS[b.language]]
    assert unknown == []


@pytest.mark.parametrize("block", [b for b in PYTHON if b.kind == ""], ids=lambda b: b.id)
def test_a_program_runs(block: Block, tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", layers=2, vocab=512, max_position_embeddings=256)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    env |= {"FD_MODEL__SOURCE": str(model), "FD_CACHE__NUM_BLOCKS": "64"}
    proc = subprocess.run([sys.executable, "-c", block.code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("block", [b for b in PYTHON if b.kind == "run-tests"], ids=lambda b: b.id)
def test_a_plugin_authors_test_passes_with_the_builtin(block: Block, tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    for binding in block.argument.split():
        name, target = binding.split("=")
        module, attr = target.split(":")
        namespace[name] = getattr(importlib.import_module(module), attr)
    exec(compile(block.code, block.id, "exec"), namespace)
    tests = {name: fn for name, fn in namespace.items() if name.startswith("test_") and callable(fn)}
    assert tests, "the block defines no test function"
    for test in tests.values():
        wanted = inspect.signature(test).parameters
        test(**({"tmp_path": tmp_path} if "tmp_path" in wanted else {}))


@pytest.mark.parametrize("block", [b for b in PYTHON if b.kind == "fragment"], ids=lambda b: b.id)
def test_a_fragment_compiles_and_its_imports_work(block: Block) -> None:
    tree = ast.parse(block.code, block.id)
    imports = ast.Module([node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))], [])
    exec(compile(imports, block.id, "exec"), {})
    assert block.argument, "say why the block is a fragment: <!-- doc: fragment (why) -->"


@pytest.mark.parametrize("block", [b for b in TOML if b.kind in ("", "router-config")], ids=lambda b: b.id)
def test_a_config_loads(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("FD_")]:
        monkeypatch.delenv(name)
    config_file = tmp_path / "config.toml"
    config_file.write_text(block.code)
    (load_router_config if block.kind == "router-config" else load_config)(config_file, cli_args=[])


@pytest.mark.parametrize("block", [b for b in TOML if b.kind == "pyproject"], ids=lambda b: b.id)
def test_a_pyproject_snippet_declares_entry_points_the_core_reads(block: Block) -> None:
    entry_points = tomllib.loads(block.code)["project"]["entry-points"]
    known = {*SEAM_GROUPS.values(), GENERAL_GROUP}
    for group, names in entry_points.items():
        assert group in known, f"{group} is not an entry-point group of fd-engine ({sorted(known)})"
        for target in names.values():
            assert re.fullmatch(r"[\w.]+(:[\w.]+)?", target), target


# --- the hook reference ------------------------------------------------------------------------

def _hookspecs() -> dict[str, object]:
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("fd_") and hasattr(fn, "fd_spec")}


def _documented_signature(name: str, function: object) -> str:
    signature = inspect.signature(function)   # annotations are strings: written as in the source
    params = ", ".join(f"{p.name}: {p.annotation}" for p in signature.parameters.values())
    return f"{name}({params}) -> {signature.return_annotation}"


@pytest.mark.parametrize("name", sorted(_hookspecs()))
def test_every_hookspec_is_documented_with_its_signature_and_what_happens_when_it_raises(name: str) -> None:
    text = (ROOT / "docs" / "plugins.md").read_text()
    heading = f"### `{_documented_signature(name, _hookspecs()[name])}`"
    assert heading in text, f"docs/plugins.md lacks {heading}"
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    assert "**If it raises" in section, f"say what happens when {name} raises"


def test_the_exit_code_table_lists_every_exit_code() -> None:
    from fd_core.exit_codes import ExitCode

    text = (ROOT / "docs" / "server.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", text, re.M)
    assert rows == [(str(code.value), code.name) for code in ExitCode]
