"""The cpu platform's allocator tuning: a step's freed buffers are reused without faulting pages in
again. Each case runs in a fresh interpreter (mallopt changes the whole process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Allocates and frees a 64 MiB buffer with the C library's malloc (as Paddle's CPU allocator
#: does for a step's activations) six times and prints the minor page faults of the last five rounds.
_ROUNDS = r"""
import ctypes, json, resource, sys
from fd_plugins.platforms.cpu import CpuPlatform, CpuSettings
note = CpuPlatform(CpuSettings(keep_freed_memory=sys.argv[1] == "on")).prepare_process()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def step():
    buffer = libc.malloc(64 << 20)
    ctypes.memset(buffer, 1, 64 << 20)   # touches every page
    libc.free(buffer)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({"note": note, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_freed_step_buffers_are_reused_without_page_faults() -> None:
    tuned, default = _run("on"), _run("off")
    assert tuned["note"].startswith("glibc malloc keeps freed memory"), tuned
    assert default["note"] == "allocator defaults (keep_freed_memory = false)"
    # glibc maps the buffer anew every round (16,384 faults of 4 KiB pages each round); tuned,
    # the heap keeps it mapped
    assert default["faults"] >= 5 * 1000, default
    assert tuned["faults"] * 20 < default["faults"], (tuned, default)


def test_a_preloaded_allocator_is_left_alone(tmp_path) -> None:
    from pathlib import Path

    library = next((p for p in Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4")), None)
    if library is None:
        pytest.skip("tcmalloc is not installed here (libtcmalloc-minimal4)")
    code = "from fd_plugins.platforms import host_tuning; print(host_tuning.keep_freed_memory())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"LD_PRELOAD": str(library), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.strip() == "allocator left as is (tcmalloc is preloaded)", proc.stderr
