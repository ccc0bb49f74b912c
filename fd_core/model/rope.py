"""Rotary position embeddings: the frequencies of each scaling type Hugging Face configs name.

A config's RoPE settings (``rope_theta`` and ``rope_scaling`` in older configs, ``rope_parameters``
in configs written by transformers 5) are parsed into a :class:`RopeScaling`; :func:`rope_tables`
turns it into cos / signed-sin tables, computed in float32 the way transformers computes them so
that greedy decoding matches it token for token. Every key of the settings is read or refused:
a key this module does not know is an error naming it, never a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

#: Scaling type -> the keys of its settings besides ``rope_type`` / ``type`` / ``rope_theta``.
KEYS: Final[dict[str, frozenset[str]]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "factor", "attention_factor",
                           "original_max_position_embeddings"}),
}
#: A GGUF's RoPE scaling: each frequency divided by its factor (llama.cpp's ``rope_freqs`` tensor, which
#: its converter writes for Llama 3.1-3.3's ``llama3`` scaling); not a type a Hugging Face config names.
FREQ_FACTORS: Final = "freq_factors"
#: Keys each type must have.
REQUIRED: Final[dict[str, frozenset[str]]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"original_max_position_embeddings"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
}


class RopeConfigError(ValueError):
    """A RoPE setting that cannot be served; ``key`` is its path in config.json."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """One model's RoPE: base ``theta``, the scaling ``type``, that type's ``params``, and the share of
    each head's dimensions that rotates (the rest pass through)."""

    theta: float = 10000.0
    type: str = "default"
    params: Mapping[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """Dimensions of a head that rotate: the first ``rotary_dim`` (transformers' convention)."""
        return int(head_dim * self.partial_rotary_factor)

    def context_length(self, max_position_embeddings: int) -> int:
        """Positions the model serves: yarn stretches the pre-trained window by its factor (as its
        configs intend: ``max_position_embeddings`` often keeps the pre-trained value); the other
        types serve ``max_position_embeddings``. ``dynamic`` stays within it, where its frequencies
        are the unscaled ones, and ``longrope`` within its pre-trained window, where they are the
        short factors (transformers switches frequencies by the longest sequence of each forward
        pass, which a paged KV cache written at earlier lengths cannot reproduce)."""
        if self.type == "longrope":
            return min(max_position_embeddings, self.params["original_max_position_embeddings"])
        if self.type != "yarn":
            return max_position_embeddings
        stretched = int(self.params["original_max_position_embeddings"] * self.params["factor"])
        return max(max_position_embeddings, stretched)


def parse_rope(config: Mapping[str, Any]) -> RopeScaling:
    """The RoPE of a Hugging Face ``config.json``; raises :class:`RopeConfigError` naming the key."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    where = "rope_parameters" if parameters else "rope_scaling"
    settings = {**scaling, **parameters}
    if isinstance(settings.get("full_attention"), Mapping):   # per-layer-type settings (Gemma-style)
        raise RopeConfigError(where, "per-layer-type RoPE settings are not supported by this architecture")
    theta = float(settings.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = settings.pop("rope_type", None) or settings.pop("type", None) or "default"
    settings.pop("type", None)
    if rope_type not in KEYS:
        raise RopeConfigError(f"{where}.rope_type", f"{rope_type!r} is not supported; supported: {', '.join(KEYS)}")
    partial = float(settings.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise RopeConfigError(f"{where}.partial_rotary_factor", f"{partial} is not in (0, 1]")
    if rope_type == "longrope" and "original_max_position_embeddings" not in settings:   # Phi-3 keeps it outside
        settings["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    unknown = sorted(settings.keys() - KEYS[rope_type])
    if unknown:
        raise RopeConfigError(f"{where}.{unknown[0]}", f"is not a setting of rope_type {rope_type!r} "
                                                       f"(it takes {', '.join(sorted(KEYS[rope_type])) or 'none'})")
    missing = sorted(REQUIRED[rope_type] - {k for k, v in settings.items() if v is not None})
    if missing:
        raise RopeConfigError(f"{where}.{missing[0]}", f"rope_type {rope_type!r} needs it")
    if rope_type in ("yarn", "longrope") and settings.get("factor") is None:   # transformers: the window's growth
        settings["factor"] = config["max_position_embeddings"] / settings["original_max_position_embeddings"]
    return RopeScaling(theta, rope_type, settings, partial)


def inverse_frequencies(rope: RopeScaling, head_dim: int) -> tuple[np.ndarray, float]:
    """float32 ``inv_freq [head_dim // 2]`` and the attention factor cos and sin are multiplied by;
    with partial rotary, the frequencies of the pairs that do not rotate are 0."""
    inv_freq, attention_factor = _rotating_frequencies(rope, rope.rotary_dim(head_dim))
    padded = np.zeros(head_dim // 2, dtype=np.float32)
    padded[: inv_freq.shape[0]] = inv_freq
    return padded, attention_factor


def _rotating_frequencies(rope: RopeScaling, dim: int) -> tuple[np.ndarray, float]:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    p = rope.params
    if rope.type == FREQ_FACTORS:
        return (inv_freq / np.asarray(p["factors"], dtype=np.float32)).astype(np.float32), 1.0
    if rope.type in ("default", "dynamic"):   # dynamic: unscaled up to max_position_embeddings
        return inv_freq, 1.0
    if rope.type == "linear":
        return (inv_freq / np.float32(p["factor"])).astype(np.float32), 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope.type == "longrope":
        return _longrope(rope, dim, exponents)
    return _yarn(rope, dim)


def _longrope(rope: RopeScaling, dim: int, exponents: np.ndarray) -> tuple[np.ndarray, float]:
    """The short factors (see :meth:`RopeScaling.context_length`) and Phi-3's attention factor."""
    p = rope.params
    short = np.asarray(p["short_factor"], dtype=np.float32)
    if short.shape != (dim // 2,):
        raise RopeConfigError("rope_scaling.short_factor", f"has {short.shape[0]} factors; {dim // 2} expected")
    factor, attention_factor = p["factor"], p.get("attention_factor")
    if attention_factor is None:
        original = p["original_max_position_embeddings"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    inv_freq = (np.float32(1.0) / (short * np.float32(rope.theta) ** exponents)).astype(np.float32)
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeScaling, dim: int) -> tuple[np.ndarray, float]:
    p = rope.params
    original, factor = p["original_max_position_embeddings"], p["factor"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_share = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(rope.theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(
        np.float32)
    extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = (interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share).astype(np.float32)
    return inv_freq, float(attention_factor)


def rotation_order(rope: RopeScaling, head_dim: int, *, interleaved: bool = False) -> np.ndarray | None:
    """How to reorder one head's q/k rows so that the kernels' rotation (pairs ``(j, j + d/2)`` at
    frequency ``j``, see :func:`rope_tables`) computes this model's: pairs ``(2i, 2i + 1)`` when
    ``interleaved`` (ERNIE), else ``(i, i + r/2)`` of the first ``r`` rotating dimensions, the
    others passing through (frequency 0). None when no reordering is needed. q.k is unchanged when
    queries and keys are reordered alike."""
    rotary = rope.rotary_dim(head_dim)
    if rotary == head_dim and not interleaved:
        return None
    if interleaved:
        first, second = np.arange(0, rotary, 2), np.arange(1, rotary, 2)
    else:
        first, second = np.arange(rotary // 2), np.arange(rotary // 2, rotary)
    passing = np.arange(rotary, head_dim)
    half = passing.shape[0] // 2
    return np.concatenate([first, passing[:half], second, passing[half:]])


def rope_tables(rope: RopeScaling, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed-sin tables ``[positions, head_dim]`` (float32, as transformers computes them).

    ``rotate_half(x) * sin == roll(x, head_dim // 2) * signed_sin`` with the first half of
    ``signed_sin`` negated, which saves the slice/negate/concat of ``rotate_half``.
    """
    inv_freq, attention_factor = inverse_frequencies(rope, head_dim)
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    if attention_factor != 1.0:   # scales the rotating pairs only (pairs j < rotary_dim / 2, see rotation_order)
        pair = np.arange(head_dim) % (head_dim // 2)
        scale = np.where(pair < rope.rotary_dim(head_dim) // 2, np.float32(attention_factor), np.float32(1.0))
        cos, sin = cos * scale, sin * scale
    sin[:, : head_dim // 2] *= -1
    return cos.astype(np.float32), sin.astype(np.float32)
