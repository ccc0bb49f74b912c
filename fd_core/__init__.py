"""fd-engine's core: seam contracts, hookspecs, plugin registry, config, engine and server.

Importing ``fd_core`` is cheap: no Paddle, FastAPI, zmq or plugin is imported until a name
that needs it is used (names resolve lazily through ``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> defining module.
_EXPORTS: dict[str, str] = {
    "FD_HOOKSPEC_VERSION": "fd_core.hookspecs",
    "hookimpl": "fd_core.hookspecs",
    "hookspec": "fd_core.hookspecs",
    "FdConfig": "fd_core.config",
    "load_config": "fd_core.config",
    "Registry": "fd_core.registry",
    "PluginRecord": "fd_core.registry",
    "resolve": "fd_core.selection",
    "Request": "fd_core.request",
    "RequestStatus": "fd_core.request",
    "FinishReason": "fd_core.request",
    "SamplingParams": "fd_core.request",
    "RequestOutput": "fd_core.outputs",
    "ScheduledRequest": "fd_core.outputs",
    "StepPlan": "fd_core.outputs",
    "StepResult": "fd_core.outputs",
    "SampledToken": "fd_core.outputs",
    "Scheduler": "fd_core.contracts.scheduler",
    "PeerDirectory": "fd_core.contracts.scheduler",
    "PeerInfo": "fd_core.contracts.scheduler",
    "ResourceManager": "fd_core.contracts.resource_manager",
    "KVLimits": "fd_core.contracts.resource_manager",
    "KVStats": "fd_core.contracts.resource_manager",
    "TokenProcessor": "fd_core.contracts.token_processor",
    "Connector": "fd_core.contracts.connector",
    "Delivery": "fd_core.contracts.connector",
    "Platform": "fd_core.contracts.platform",
    "DetectResult": "fd_core.contracts.platform",
    "MemoryProfile": "fd_core.contracts.platform",
    "LLM": "fd_core.engine.llm",
    "AsyncLLM": "fd_core.engine.async_llm",
    "CompletionResult": "fd_core.engine.results",
    "EngineCore": "fd_core.engine.core",
    "build_engine": "fd_core.engine.builder",
    "FdDeprecationWarning": "fd_core.compat",
    "FdError": "fd_core.errors",
    "ConfigError": "fd_core.errors",
    "PluginError": "fd_core.errors",
    "PluginLoadError": "fd_core.errors",
    "PluginNotFoundError": "fd_core.errors",
    "PluginVersionError": "fd_core.errors",
    "ModelLoadError": "fd_core.errors",
    "RequestError": "fd_core.errors",
    "QueueFullError": "fd_core.errors",
    "EngineDeadError": "fd_core.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fd_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from fd_core.compat import FdDeprecationWarning
    from fd_core.config import FdConfig, load_config
    from fd_core.contracts.connector import Connector, Delivery
    from fd_core.contracts.platform import DetectResult, MemoryProfile, Platform
    from fd_core.contracts.resource_manager import KVLimits, KVStats, ResourceManager
    from fd_core.contracts.scheduler import PeerDirectory, PeerInfo, Scheduler
    from fd_core.contracts.token_processor import TokenProcessor
    from fd_core.engine.async_llm import AsyncLLM
    from fd_core.engine.builder import build_engine
    from fd_core.engine.core import EngineCore
    from fd_core.engine.llm import LLM
    from fd_core.engine.results import CompletionResult
    from fd_core.errors import (
        ConfigError,
        EngineDeadError,
        FdError,
        ModelLoadError,
        PluginError,
        PluginLoadError,
        PluginNotFoundError,
        PluginVersionError,
        QueueFullError,
        RequestError,
    )
    from fd_core.hookspecs import FD_HOOKSPEC_VERSION, hookimpl, hookspec
    from fd_core.outputs import RequestOutput, SampledToken, ScheduledRequest, StepPlan, StepResult
    from fd_core.registry import PluginRecord, Registry
    from fd_core.request import FinishReason, Request, RequestStatus, SamplingParams
    from fd_core.selection import resolve
