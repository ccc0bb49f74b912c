"""Seeded synthetic workloads shared by the online and offline benchmarks.

Prompts are random token ids, so every engine (and a server over HTTP) receives exactly the
same tokens; lengths are drawn uniformly from ``[len * (1 - ratio), len * (1 + ratio)]``, as
``vllm bench`` does with ``--dataset-name random``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np

#: Token ids below this are not drawn (special tokens live at the start of most vocabularies).
LOWEST_PROMPT_TOKEN: Final = 100


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload."""

    prompt: list[int]   # token ids
    output_len: int     # tokens to generate (with ignore_eos)


def make_workload(*, num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int, output_range_ratio: float | None = None) -> list[WorkItem]:
    """Seeded random token-id prompts with uniformly drawn input and output lengths.

    ``output_range_ratio`` defaults to ``range_ratio``; 0 gives every request ``output_len``.
    """
    rng = np.random.default_rng(seed)
    lowest = min(LOWEST_PROMPT_TOKEN, vocab_size // 4)

    def lengths(mean: int, ratio: float) -> np.ndarray:
        low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
        return rng.integers(low, high + 1, num_prompts)

    inputs = lengths(input_len, range_ratio)
    outputs = lengths(output_len, range_ratio if output_range_ratio is None else output_range_ratio)
    return [WorkItem(rng.integers(lowest, vocab_size, int(n)).tolist(), int(o))
            for n, o in zip(inputs, outputs, strict=True)]
