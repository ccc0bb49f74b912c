"""A connector that drops every block message it is asked to send (breaks "block buffers arrive")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import fd_core
from fd_plugins.connectors.zmq_connector import ZmqConnector


class DropsBlocks(ZmqConnector):
    """zmq, except that a message with buffers is reported sent and never is."""

    name: ClassVar[str] = "drops-blocks"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION

    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        if buffers:
            return True
        return super().send(peer, message, buffers)
