"""Exit statuses in words: signals by name with their likely cause."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from fd_core.exit_status import describe_exit


@pytest.mark.parametrize(("code", "text"), [
    (0, "exit code 0"),
    (1, "exit code 1"),
    (-signal.SIGILL, "SIGILL: illegal instruction — a kernel uses a CPU feature this machine lacks"),
    (-signal.SIGKILL, "SIGKILL: killed — by an operator, or by the kernel's out-of-memory killer"),
    (-signal.SIGUSR1, "SIGUSR1"),
    (-200, "signal 200"),
    (None, "still running (not reaped)"),
])
def test_describe_exit(code: int | None, text: str) -> None:
    assert describe_exit(code) == text


def test_a_real_child_killed_by_a_signal() -> None:
    proc = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
                          capture_output=True)
    assert describe_exit(proc.returncode).startswith("SIGSEGV: segmentation fault")
