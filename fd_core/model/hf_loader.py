"""Read a Hugging Face model folder: the architecture plugin that runs it, its shape, float32 weights.

The folder holds ``config.json``, ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``) and optionally ``generation_config.json`` (EOS ids).
Safetensors files are parsed here directly (8-byte header length, JSON header, raw data) so
bfloat16 tensors, which numpy has no dtype for, load by widening their bits to float32.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fd_core.contracts.architecture import ArchitectureConfigError
from fd_core.errors import ModelLoadError
from fd_core.model.architectures import ArchitecturePlugins

if TYPE_CHECKING:
    from fd_core.contracts.architecture import ModelArchitecture, ModelShape

#: safetensors dtype -> numpy dtype of the stored bits (BF16 is widened after reading).
_SAFETENSORS_DTYPES: Final[Mapping[str, str]] = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}

#: Checkpoint entries that are buffers, not weights (old Llama checkpoints save them).
_IGNORED_SUFFIXES: Final = ("rotary_emb.inv_freq",)


def load_hf_folder(folder: str | Path, plugin: ModelArchitecture | None = None,
                   ) -> tuple[ModelShape, dict[str, np.ndarray]]:
    """The shape and float32 weights (Hugging Face names, as the plugin's ``prepare_weights`` laid
    them out) of the model in ``folder``; ``plugin`` default: :func:`hf_architecture`'s choice."""
    folder = Path(folder)
    plugin = plugin or hf_architecture(folder)
    arch = read_hf_config(folder, plugin)
    weights: dict[str, np.ndarray] = {}
    for shard in _weight_files(folder):
        weights.update(read_safetensors(shard))
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]
    if getattr(arch, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    return arch, plugin.prepare_weights(arch, weights)


def hf_architecture(folder: str | Path, plugins: ArchitecturePlugins | None = None) -> ModelArchitecture:
    """The architecture plugin (of ``plugins``, default every installed one) for ``config.json``."""
    path = Path(folder) / "config.json"
    return (plugins or ArchitecturePlugins()).for_hf(_read_json(path, required=True).get("architectures") or [],
                                                     str(path))


def read_hf_config(folder: str | Path, plugin: ModelArchitecture | None = None) -> ModelShape:
    """The shape ``plugin`` (default: :func:`hf_architecture`'s choice) parses from ``config.json``
    and ``generation_config.json``; raises ModelLoadError naming the key it refused."""
    folder = Path(folder)
    plugin = plugin or hf_architecture(folder)
    config = _read_json(folder / "config.json", required=True)
    generation = _read_json(folder / "generation_config.json", required=False)
    try:
        return plugin.parse_hf_config(config, generation)
    except ArchitectureConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e} (architecture plugin {plugin.name!r})") from e


def read_eos_token_ids(folder: str | Path) -> tuple[int, ...]:
    """The EOS ids ``generation_config.json`` (else ``config.json``) names, without parsing the model."""
    folder = Path(folder)
    generation = _read_json(folder / "generation_config.json", required=False)
    eos = generation.get("eos_token_id", _read_json(folder / "config.json", required=True).get("eos_token_id"))
    return tuple([eos] if isinstance(eos, int) else eos or ())


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as float32 arrays (F32, F16, BF16 or F64 stored)."""
    path = Path(path)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        header_len = int(data[:8].view("<u8")[0])
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (IndexError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a safetensors file ({e})") from e
    base = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; "
                f"supported: {', '.join(_SAFETENSORS_DTYPES)}"
            )
        start, end = info["data_offsets"]
        raw = data[base + start : base + end].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            tensors[name] = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            tensors[name] = raw.astype(np.float32)
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index, required=True)["weight_map"]
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = [folder / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{folder}: weight file(s) missing: {', '.join(missing)}")
    return files


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} not found")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
