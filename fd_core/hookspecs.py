"""The pluggy hook specifications of fd-engine (project name ``"fd"``), versioned.

Three families:

* **Seam registration** — a general plugin (entry-point group ``fd.plugins``) may contribute
  seam implementations without an entry point per class by returning classes from
  ``fd_register_<seam>s``.
* **Decisions** (``firstresult``) — where a user would otherwise subclass a built-in: the order
  of waiting requests, the preemption victim, the prefill chunk size. Returning ``None``
  defers to the next implementation and finally to the built-in default.
* **Lifecycle** — notifications; return values are ignored. They run on the engine thread, so
  keep them cheap.

Every plugin declares ``fd_hookspec_version``; ``fd_core.compat`` decides which versions each
seam still loads (older ones with a deprecation warning), and the registry refuses the others,
naming the plugin, the change and the fix.

A decision hook that raises, or answers something the caller cannot use, is reported once
(naming the plugin and the hook) and skipped; see ``fd_core.plugin_guard``.

Versions (``fd_core.compat`` lists what each changed; ``CHANGELOG.md`` says how to port):

* 1 — the first release.
* 2 — the engine core alone ends requests (token processor and resource manager contracts).
* 3 — the ``Connector`` contract became the transport of the core's prefill/decode hand-off.
* 4 — the model-architecture seam (``fd.models``, ``fd_register_models``), the guided-decoding seam
  (``fd.guided_decoding``, ``fd_register_guided_decoding``), the tool-parser seam
  (``fd.tool_parsers``, ``fd_register_tool_parsers``) and the reasoning-parser seam
  (``fd.reasoning_parsers``, ``fd_register_reasoning_parsers``).
* 5 — the speculative-proposer seam (``fd.proposers``, ``fd_register_proposers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import pluggy

if TYPE_CHECKING:
    from fd_core.config import FdConfig
    from fd_core.outputs import RequestOutput, StepPlan, StepResult
    from fd_core.request import Request

PROJECT_NAME: Final = "fd"
#: Bumped when a hook or a seam contract changes incompatibly.
FD_HOOKSPEC_VERSION: Final = 5
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- seam registration (added in version 1) ------------------------------------------------

@hookspec
def fd_register_schedulers() -> list[type]:
    """Return Scheduler classes to register (each has a ``name``). Added in version 1."""


@hookspec
def fd_register_resource_managers() -> list[type]:
    """Return ResourceManager classes to register. Added in version 1."""


@hookspec
def fd_register_token_processors() -> list[type]:
    """Return TokenProcessor classes to register. Added in version 1."""


@hookspec
def fd_register_connectors() -> list[type]:
    """Return Connector classes to register. Added in version 1."""


@hookspec
def fd_register_platforms() -> list[type]:
    """Return Platform classes to register. Added in version 1."""


@hookspec
def fd_register_models() -> list[type]:
    """Return ModelArchitecture classes to register. Added in version 4."""


@hookspec
def fd_register_guided_decoding() -> list[type]:
    """Return GuidedDecodingBackend classes to register. Added in version 4."""


@hookspec
def fd_register_tool_parsers() -> list[type]:
    """Return ToolParser classes to register. Added in version 4."""


@hookspec
def fd_register_reasoning_parsers() -> list[type]:
    """Return ReasoningParser classes to register. Added in version 4."""


@hookspec
def fd_register_proposers() -> list[type]:
    """Return Proposer classes to register. Added in version 5."""


# --- decisions (firstresult; added in version 1) --------------------------------------------

@hookspec(firstresult=True)
def fd_order_waiting(waiting: list[Request], now: float) -> list[Request] | None:
    """Return the waiting requests in the order they should be admitted, or ``None`` for FIFO.

    Called by the request scheduler whenever the engine asks for new requests. The result must
    be a permutation of ``waiting``. Added in version 1.
    """


@hookspec(firstresult=True)
def fd_select_preemption_victim(running: list[Request], needed_by: Request) -> Request | None:
    """Pick the running request to preempt so that ``needed_by`` gets KV blocks, or ``None``.

    ``running`` is in admission order and never empty; ``v1``'s default takes the last admitted
    of the call (``Request.call_id``) running the most requests.
    The victim may be ``needed_by`` itself. Added in version 1.
    """


@hookspec(firstresult=True)
def fd_prefill_chunk_size(request: Request, remaining_prompt: int, budget: int) -> int | None:
    """Return how many prompt tokens of ``request`` to compute this step, or ``None``.

    The engine clamps the answer to ``[1, min(remaining_prompt, budget)]``. Added in version 1.
    """


# --- lifecycle (added in version 1) ---------------------------------------------------------

@hookspec
def fd_engine_started(config: FdConfig) -> None:
    """The engine finished start-up and is about to take requests. Added in version 1."""


@hookspec
def fd_engine_stopped() -> None:
    """The engine loop ended. Added in version 1."""


@hookspec
def fd_request_added(request: Request) -> None:
    """A request entered the engine (after validation). Added in version 1."""


@hookspec
def fd_request_finished(request: Request, output: RequestOutput) -> None:
    """A request finished for any reason; ``output`` is its final delta. Added in version 1."""


@hookspec
def fd_step_finished(plan: StepPlan, result: StepResult, stats: dict[str, Any]) -> None:
    """One engine step completed; ``stats`` holds the resource manager's counters. Added in v1."""
