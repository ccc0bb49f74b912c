"""Import Paddle without the noise its import prints on machines that are set up correctly.

Importing Paddle prints "No ccache found" (a UserWarning about compiling C++ extensions, which
fd-engine never does) and, whenever ``OMP_NUM_THREADS`` is above 1 (fd-engine sets it to the
core count), a two-line "WARNING: OMP_NUM_THREADS set to ..." about data-parallel training.
Both appeared on every ``--check`` and at every start-up. :func:`import_paddle` imports it once
with exactly those messages removed; anything else Paddle prints still reaches stderr.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from typing import Final

#: Lines of Paddle's import-time stderr output that say nothing about this program.
_NOISE: Final = ("WARNING: OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY.")


def import_paddle() -> None:
    """Import Paddle (a no-op once imported) without its known noise; ImportError propagates."""
    if "paddle" in sys.modules:
        return
    captured = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(captured):
        warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
        try:
            import paddle  # noqa: F401
        finally:
            kept = [line for line in captured.getvalue().splitlines(keepends=True) if not line.startswith(_NOISE)]
            sys.stderr.write("".join(kept))
