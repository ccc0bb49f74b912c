"""Read a Hugging Face model folder into a :class:`LlamaArchConfig` and float32 numpy weights.

The folder holds ``config.json``, ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``) and optionally ``generation_config.json`` (EOS ids).
Safetensors files are parsed here directly (8-byte header length, JSON header, raw data) so
bfloat16 tensors, which numpy has no dtype for, load by widening their bits to float32.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from fd_core.errors import ModelLoadError
from fd_core.model.arch import SUPPORTED_ARCHITECTURES, LlamaArchConfig

#: safetensors dtype -> numpy dtype of the stored bits (BF16 is widened after reading).
_SAFETENSORS_DTYPES: Final[Mapping[str, str]] = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}

#: Checkpoint entries that are buffers, not weights (old Llama checkpoints save them).
_IGNORED_SUFFIXES: Final = ("rotary_emb.inv_freq",)


def load_hf_folder(folder: str | Path) -> tuple[LlamaArchConfig, dict[str, np.ndarray]]:
    """Architecture and float32 weights (Hugging Face names) of the model in ``folder``."""
    folder = Path(folder)
    arch = read_hf_config(folder)
    weights: dict[str, np.ndarray] = {}
    for shard in _weight_files(folder):
        weights.update(read_safetensors(shard))
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    return arch, weights


def read_hf_config(folder: str | Path) -> LlamaArchConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for EOS ids) of a Llama-family model."""
    folder = Path(folder)
    config = _read_json(folder / "config.json", required=True)
    generation = _read_json(folder / "generation_config.json", required=False)
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else config.get("model_type", "<missing>")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{folder / 'config.json'}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope_scaling = config.get("rope_scaling") or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{folder / 'config.json'}: rope_scaling type {rope_type!r} is not supported")
    # transformers >= 5 writes rope_theta inside rope_parameters
    rope_theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = config["num_attention_heads"]
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    try:
        return LlamaArchConfig(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and its config has no flag for them
            attention_bias=config.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            bos_token_id=generation.get("bos_token_id", config.get("bos_token_id")),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos or ()),
        )
    except KeyError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: missing key {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


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
