"""Memory freed after loading goes back to the system even when the allocator is tuned to keep it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fd_core.host_memory import glibc

PROBE = """
import json, os, numpy as np
from fd_core.host_memory import release_freed_memory
from fd_plugins.platforms.host_tuning import keep_freed_memory

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

note = keep_freed_memory()            # as the cpu platform does before a model loads
garbage = [np.ones(1 << 20, dtype=np.float32) for _ in range(64)]   # 256 MiB of load-time arrays
held = rss_mib()
del garbage
kept = rss_mib()
released = release_freed_memory()
print(json.dumps({"note": note, "held": held, "kept": kept, "released": released, "after": rss_mib()}))
"""


@pytest.mark.skipif(glibc() is None, reason="the C library is not glibc")
def test_memory_freed_after_loading_is_given_back_under_the_tuned_allocator():
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["note"].startswith("glibc malloc keeps freed memory"), out
    assert out["held"] - out["kept"] < 64, f"the tuned allocator should keep the freed arrays: {out}"
    assert out["released"] and out["kept"] - out["after"] >= 192, out
