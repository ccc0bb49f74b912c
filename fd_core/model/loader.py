"""Load a model from a source string: a model alias, a Hugging Face folder or a ``.gguf`` file.

:func:`load_model` dispatches to the right reader, finds the model-architecture plugin that
runs the checkpoint (``fd_core.model.architectures``), builds the tokenizer beside the weights
and checks that the weights are exactly the set (names and shapes) the plugin says the
architecture needs, so a model that loads is a model its plugin can build.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fd_core.contracts.architecture import ModelArchitecture, ModelShape
from fd_core.errors import ModelLoadError
from fd_core.model.architectures import ArchitecturePlugins
from fd_core.model.default_model import DEFAULT_MODEL_ALIAS, MODEL_ALIASES, resolve_alias
from fd_core.model.tokenizer import Tokenizer
from fd_kernels.quantized import BlockQuantized


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Everything needed to run a model: the plugin that builds it, its shape, weights and tokenizer."""

    architecture: ModelArchitecture
    arch: ModelShape
    # Hugging Face names -> float32 arrays (see arch.py), or matrices kept in GGUF blocks
    weights: dict[str, np.ndarray | BlockQuantized]
    tokenizer: Tokenizer
    source_path: Path  # the folder or .gguf file the model was read from

    def __repr__(self) -> str:
        weights = f"<{len(self.weights)} tensors>"
        return f"LoadedModel(arch={self.arch!r}, weights={weights}, source_path={self.source_path!r})"


def model_source_kind(source: str) -> Literal["alias", "folder", "gguf"]:
    """What ``source`` is, judged without reading or fetching it; raises ModelLoadError saying why
    it is none of an alias from ``MODEL_ALIASES``, a folder holding ``config.json`` and a ``.gguf``
    file. Start-up validation calls it before any heavy work, and the loaders dispatch on it."""
    if source in MODEL_ALIASES:
        return "alias"
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{str(path)!r} is a folder without config.json; a Hugging Face model "
                                 "folder holds config.json, *.safetensors and tokenizer.json")
        return "folder"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.exists():
        raise ModelLoadError(f"{str(path)!r} is neither a model folder nor a .gguf file")
    close = difflib.get_close_matches(source, list(MODEL_ALIASES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ModelLoadError(
        f"model {source!r} not found: no such file or folder, and not a known alias "
        f"({', '.join(MODEL_ALIASES)}); expected a Hugging Face folder, a .gguf file or an alias{hint}"
    )


def load_model(source: str = DEFAULT_MODEL_ALIAS, *, keep_quantized: bool = False,
               plugins: ArchitecturePlugins | None = None) -> LoadedModel:
    """Load ``source``: an alias from ``MODEL_ALIASES``, a Hugging Face folder or a ``.gguf`` file.

    ``keep_quantized``: a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matrices stay in their blocks (see
    ``fd_core.model.gguf_loader``); a folder's weights are float32 either way. ``plugins``: the
    architecture plugins to choose from (default: every installed one).
    """
    plugins = plugins or ArchitecturePlugins()
    kind = model_source_kind(source)
    if kind == "alias":
        return _load_gguf(resolve_alias(source), keep_quantized, plugins)
    path = Path(source).expanduser()
    return _load_folder(path, plugins) if kind == "folder" else _load_gguf(path, keep_quantized, plugins)


def _load_folder(folder: Path, plugins: ArchitecturePlugins) -> LoadedModel:
    from fd_core.model.hf_loader import hf_architecture, load_hf_folder

    architecture = hf_architecture(folder, plugins)
    arch, weights = load_hf_folder(folder, architecture)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_token_ids=arch.eos_token_ids)
    # generation_config.json and tokenizer_config.json may each name an EOS; stop on all of them
    arch = dataclasses.replace(arch, eos_token_ids=tokenizer.eos_token_ids)
    _check_weights(architecture, arch, weights, folder)
    return LoadedModel(architecture=architecture, arch=arch, weights=weights, tokenizer=tokenizer,
                       source_path=folder)


def _load_gguf(path: Path, keep_quantized: bool, plugins: ArchitecturePlugins) -> LoadedModel:
    from fd_core.model.gguf_loader import load_gguf

    arch, weights, metadata = load_gguf(path, keep_quantized=keep_quantized, plugins=plugins)
    architecture = plugins.for_gguf(metadata["general.architecture"], str(path))
    tokenizer = Tokenizer.from_gguf_metadata(metadata, source=str(path))
    _check_weights(architecture, arch, weights, path)
    return LoadedModel(architecture=architecture, arch=arch, weights=weights, tokenizer=tokenizer, source_path=path)


def _check_weights(architecture: ModelArchitecture, arch: ModelShape,
                   weights: dict[str, np.ndarray | BlockQuantized], source: Path) -> None:
    """Raise unless ``weights`` has exactly the names and shapes ``architecture`` says ``arch`` needs."""
    expected = architecture.weight_shapes(arch)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [
        f"{n} {weights[n].shape} (expected {s})"
        for n, s in expected.items()
        if n in weights and weights[n].shape != s
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append(
            f"unexpected tensors: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else "")
        )
    if wrong:
        problems.append(f"wrong shapes: {', '.join(wrong[:8])}")
    if problems:
        raise ModelLoadError(f"{source}: weights do not match {arch.architecture}: " + "; ".join(problems))


def load_tokenizer(source: str = DEFAULT_MODEL_ALIAS) -> Tokenizer:
    """Only the tokenizer of ``source`` (resolved as :func:`load_model` does), without reading weights.

    The server's front end uses it: it tokenizes and renders chat templates while the engine
    process holds the model.
    """
    kind = model_source_kind(source)
    if kind == "alias":
        return _gguf_tokenizer(resolve_alias(source))
    path = Path(source).expanduser()
    if kind == "folder":
        from fd_core.model.hf_loader import read_eos_token_ids

        return Tokenizer.from_folder(path, extra_eos_token_ids=read_eos_token_ids(path))
    return _gguf_tokenizer(path)


def _gguf_tokenizer(path: Path) -> Tokenizer:
    from fd_core.model.gguf_file import read_gguf

    try:
        reader = read_gguf(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    metadata = {key: value for key, value in reader.metadata.items() if key.startswith("tokenizer.")}
    return Tokenizer.from_gguf_metadata(metadata, source=str(path))
