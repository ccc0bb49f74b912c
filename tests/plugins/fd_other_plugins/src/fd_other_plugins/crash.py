"""A cpu platform whose engine process dies of a real SIGILL while it starts up.

fd-engine's tests select it (``platform.name = "sigill"``) to check that a native crash during
start-up is reported by signal name and stage. Never picked by ``auto``: lowest priority.
"""

from __future__ import annotations

import os
import signal
from typing import ClassVar

from fd_core import MemoryProfile
from fd_plugins.platforms.cpu import CpuPlatform


class SigillPlatform(CpuPlatform):
    name: ClassVar[str] = "sigill"
    priority: ClassVar[int] = -100

    def memory_profile(self) -> MemoryProfile:
        """Called while the engine sizes its KV pool, after the model is loaded."""
        os.kill(os.getpid(), signal.SIGILL)
        raise AssertionError("unreachable: SIGILL ends the process")
