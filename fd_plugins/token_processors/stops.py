"""Stop-string matching over streamed text, holding back text that may begin a stop string.

Text arrives in deltas whose boundaries fall anywhere (a token may end in the middle of a stop
string). :class:`StopStringMatcher` keeps back the longest tail of the text seen so far that is
a proper prefix of some stop string, so that what it releases can never turn out to be part of
a stop string later: streamed deltas never contain a piece of a stop string.

Which match wins: the one that *ends* first (ties: the one that starts first, i.e. the longer
one). That is the match a character-by-character stream would see first, so the result does
not depend on how the text was split into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopStringMatcher:
    """Per-request stop-string state.

    Invariant: ``pending`` is a proper prefix of some stop string (so shorter than the longest),
    and it holds the only text seen but not released.
    """

    stops: tuple[str, ...]                   # non-empty stop strings
    include_stop_str: bool = False           # release the stop string itself before stopping
    pending: str = ""                        # held back: might begin a stop string
    _first_chars: frozenset[str] = field(init=False, repr=False)
    _max_hold: int = field(init=False, repr=False)   # longest proper prefix length

    def __post_init__(self) -> None:
        assert self.stops and all(self.stops), "stop strings must be non-empty"
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._max_hold = max(len(s) for s in self.stops) - 1

    @classmethod
    def build(cls, stops: list[str], *, include_stop_str: bool) -> StopStringMatcher | None:
        """A matcher for the request's non-empty stop strings; None when there are none."""
        kept = tuple(dict.fromkeys(s for s in stops if s))
        return cls(kept, include_stop_str) if kept else None

    def feed(self, text: str, *, active: bool) -> tuple[str, bool]:
        """Add ``text``; return ``(releasable text, matched)``.

        With ``active`` False (before ``min_tokens``) a stop string completed by ``text`` is
        ignored and released like any other text. On a match the text is cut before the stop
        string (or after it with ``include_stop_str``); anything after it is dropped.
        """
        buf = self.pending + text
        if active:
            seen = len(self.pending)   # a new match must end inside ``text``
            best: tuple[int, int] | None = None   # (end, start)
            for stop in self.stops:
                start = buf.find(stop, max(0, seen - len(stop) + 1))
                if start >= 0 and (best is None or (start + len(stop), start) < best):
                    best = (start + len(stop), start)
            if best is not None:
                self.pending = ""
                return buf[:best[0] if self.include_stop_str else best[1]], True
        hold = self._held_length(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """Release the held-back text (the request ends for another reason)."""
        text, self.pending = self.pending, ""
        return text

    def _held_length(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-k] not in self._first_chars:
                continue
            tail = buf[-k:]
            if any(len(stop) > k and stop.startswith(tail) for stop in self.stops):
                return k
        return 0
