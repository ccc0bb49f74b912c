"""Prompt lookup: what followed the last n-gram of a request's tokens the last time it occurred.

:class:`SeenTokens` keeps a request's prompt and outputs as one numpy array, extended by the new
outputs of each step and rebuilt from the request whenever its tokens are not an extension of those
it holds; :func:`continuation` searches that array with a few vectorised comparisons (no Python loop
over the tokens), so a request of thousands of tokens costs tens of microseconds a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fd_core.request import Request


class SeenTokens:
    """One request's ``prompt_token_ids + output_token_ids`` as an int64 array, kept in step with it."""

    __slots__ = ("_array", "_length", "_outputs", "_prompt")

    def __init__(self) -> None:
        self._prompt: list[int] = []     # copies of what the array was built from: the request is checked against them
        self._outputs: list[int] = []
        self._array = np.empty(0, dtype=np.int64)   # room to grow; the first _length entries are the tokens
        self._length = 0

    def sync(self, request: Request) -> np.ndarray:
        """The request's tokens: the new outputs appended when its tokens extend those seen before,
        else rebuilt from the request (a continuation, a token list replaced or cut back)."""
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        seen = len(self._outputs)
        if len(outputs) < seen or prompt != self._prompt or outputs[:seen] != self._outputs:
            self._rebuild(prompt, outputs)
        elif len(outputs) > seen:
            self._append(outputs[seen:])
        return self._array[:self._length]

    def _rebuild(self, prompt: list[int], outputs: list[int]) -> None:
        self._prompt, self._outputs = list(prompt), []
        self._array = np.empty(max(2 * (len(prompt) + len(outputs)), 64), dtype=np.int64)
        self._array[:len(prompt)] = prompt
        self._length = len(prompt)
        self._append(outputs)

    def _append(self, new: list[int]) -> None:
        end = self._length + len(new)
        if end > len(self._array):   # doubling keeps appends amortised O(1) per token
            grown = np.empty(2 * end, dtype=np.int64)
            grown[:self._length] = self._array[:self._length]
            self._array = grown
        self._array[self._length:end] = new
        self._length = end
        self._outputs.extend(new)


def continuation(tokens: np.ndarray, *, min_n: int, max_n: int, budget: int) -> list[int]:
    """Up to ``budget`` tokens that followed the most recent earlier occurrence of the longest suffix
    of ``tokens`` between ``min_n`` and ``max_n`` tokens long (a longer suffix wins over a more recent
    one); ``[]`` when no suffix of ``min_n`` tokens occurs earlier.

    Where the tokens that followed run into the end of ``tokens``, the proposal goes on as if the text
    repeats with the period of the match: after ``x y z x y`` (``x y`` occurred 3 tokens earlier),
    ``z x y z``.
    """
    size = len(tokens)
    if budget < 1 or size <= min_n:   # a suffix of min_n tokens and an earlier occurrence need min_n + 1
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])   # where an earlier occurrence may end
    if len(ends) == 0:
        return []
    lengths = np.ones(len(ends), dtype=np.int64)       # tokens each matches, back from its end
    alive = np.arange(len(ends))                       # the candidates still matching
    for back in range(1, max_n):
        alive = alive[ends[alive] >= back]
        alive = alive[tokens[ends[alive] - back] == tokens[size - 1 - back]]
        if len(alive) == 0:
            break
        lengths[alive] += 1
    longest = lengths.max()
    if longest < min_n:
        return []
    end = ends[np.flatnonzero(lengths == longest)[-1]]   # ends ascend: the last is the most recent
    return np.resize(tokens[end + 1:], budget).tolist()   # resize repeats the followers cyclically
