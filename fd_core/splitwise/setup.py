"""Build an instance's part in hand-offs from its config: the connector, the directory, its side."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fd_core.contracts.scheduler import PeerInfo
from fd_core.splitwise.decode import DecodeSide
from fd_core.splitwise.kv_blocks import KVBlockViews
from fd_core.splitwise.prefill import PrefillSide
from fd_core.splitwise.roles import MIXED, EngineHandoff

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.contracts.resource_manager import ResourceManager
    from fd_core.contracts.scheduler import PeerDirectory
    from fd_core.runner.model_runner import ModelRunner
    from fd_core.selection import Selection


def build_handoff(config: FdConfig, selection: Selection, *, scheduler: PeerDirectory | Any,
                  resource_manager: ResourceManager, runner: ModelRunner, model_name: str) -> EngineHandoff:
    """The role's side (not started: :meth:`EngineHandoff.start` binds and publishes it)."""
    role = config.splitwise.role
    if role == "mixed":
        return MIXED
    connector_plugin = selection["connector"]
    instance_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    connector = connector_plugin.create(role=role, instance_id=instance_id)
    kv = KVBlockViews(runner.kv_caches)
    me = PeerInfo(instance_id, role, "", connector_plugin.name, host_id(), f"model={model_name},{kv.layout}")
    common: dict[str, Any] = {"connector": connector, "directory": scheduler, "settings": config.splitwise, "me": me}
    if role == "decode":
        return DecodeSide(resource_manager=resource_manager, kv=kv, **common)
    side = PrefillSide(kv=kv, block_size=config.cache.block_size, max_queued=config.server.max_queue_size, **common)
    selection.registry.plugin_manager.register(side.victim_rule, name="fd-core/splitwise-prefill")
    return side


def host_id() -> str:
    """This machine's identity for same-host connectors: the kernel's boot id (the host name without one)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
