"""Say how a child process ended, by signal name and likely cause, for logs, /health and errors."""

from __future__ import annotations

import signal
from typing import Final

#: Likely causes of the signals an engine process dies of.
SIGNAL_CAUSES: Final = {
    signal.SIGILL: "illegal instruction — a kernel uses a CPU feature this machine lacks",
    signal.SIGKILL: "killed — by an operator, or by the kernel's out-of-memory killer",
    signal.SIGSEGV: "segmentation fault — a bug in a native kernel or extension",
    signal.SIGBUS: "bus error — a native kernel read memory that is gone (shared memory or a file)",
    signal.SIGFPE: "arithmetic fault in a native kernel",
    signal.SIGABRT: "aborted — a native library gave up (see the lines before in the log)",
    signal.SIGTERM: "terminated from outside",
}


def describe_exit(exitcode: int | None) -> str:
    """``multiprocessing``/``subprocess`` exit status as words.

    Negative codes are signals (``-4`` -> ``SIGILL: illegal instruction — ...``); ``None``
    means the process has not been reaped, which callers should avoid by joining first.
    """
    if exitcode is None:
        return "still running (not reaped)"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        sig = signal.Signals(-exitcode)
    except ValueError:
        return f"signal {-exitcode}"
    cause = SIGNAL_CAUSES.get(sig)
    return f"{sig.name}: {cause}" if cause else sig.name
