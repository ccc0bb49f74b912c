"""The compatibility promise to plugin authors, in code: which hookspec versions each seam loads.

The policy (``docs/compatibility.md`` explains it, ``CHANGELOG.md`` has a migration note for each
change below):

* A plugin declares the hookspec version it was written for (``fd_hookspec_version``).
* A version older than :data:`~fd_core.hookspecs.FD_HOOKSPEC_VERSION` keeps loading, with a
  :class:`FdDeprecationWarning` naming what changed since and the fix, as long as no change in
  between broke its seam (:data:`BREAKING`). It keeps loading so until :data:`LOADS_UNTIL`.
* A seam whose contract changed incompatibly refuses plugins written before the change: the
  error names the change and the CHANGELOG section that says how to port.
* Additions (a new optional method with a default, a new hook) are not breaking: they go in a
  minor release. Removing or changing a method or hook a plugin implements or calls is
  breaking: it bumps the hookspec version and is listed in :data:`BREAKING`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Final

from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_core.seams import SEAMS

log = logging.getLogger(__name__)

#: Every kind of plugin a version applies to: the seams, and "general" (hook implementations).
KINDS: Final = (*(seam.name for seam in SEAMS), "general")

#: Version -> kind -> the incompatible change that version made to that kind's contract.
BREAKING: Final[dict[int, dict[str, str]]] = {
    2: {"token_processor": "the engine core ends requests: a token processor reports a finish in its "
                           "output's finish_reason, has forget(request_id) instead of finish(), and is "
                           "built without a resource_manager",
        "resource_manager": "ResourceManager.abort was removed (finish_requests(..., FinishReason.ABORT) "
                            "replaces it) and a manager no longer sets FINISHED"},
    3: {"connector": "the Connector contract became the transport of the core's prefill/decode hand-off "
                     "(start/send/receive/wake and block messages replace send(KVTransfer)/receive())"},
    4: {"architecture": "the model-architecture seam was added (a plugin of it cannot predate it)",
        "guided_decoding": "the guided-decoding seam was added (a plugin of it cannot predate it)",
        "tool_parser": "the tool-parser seam was added (a plugin of it cannot predate it)",
        "reasoning_parser": "the reasoning-parser seam was added (a plugin of it cannot predate it)"},
    5: {"proposer": "the proposer seam was added (a plugin of it cannot predate it)"},
}

#: Version -> what it changed compatibly (a plugin written before it needs no change for it).
ADDITIONS: Final[dict[int, str]] = {
    2: "ResourceManager.supports_prefix_caching was added; Platform.capabilities is read per instance",
    3: "ResourceManager.reserve was added (optional, for decode instances)",
    4: "the model-architecture seam (fd.models entry points, the fd_register_models hook) was added; "
       "the guided-decoding, tool-parser and reasoning-parser seams (fd.guided_decoding, fd.tool_parsers, "
       "fd.reasoning_parsers and their fd_register_* hooks) were added; "
       "Scheduler.note_capacity and Scheduler.drain were added (optional)",
    5: "the proposer seam (fd.proposers entry points, the fd_register_proposers hook) was added; "
       "Request.spec_token_ids was added (tokens a proposer guessed, which a resource manager may plan after the "
       "known ones; a manager that ignores them keeps working, without speculation); TokenProcessor.process may "
       "be called several times in one step, once per token of a verified run",
}

#: Deprecated versions keep loading (where their seam allows) up to, not including, this release.
LOADS_UNTIL: Final = "0.4.0"


class FdDeprecationWarning(DeprecationWarning):
    """A plugin relies on something that still works but will stop working in a later release."""


def oldest_loadable(kind: str) -> int:
    """The oldest hookspec version a plugin of ``kind`` may declare: the version of the last
    breaking change to that kind (1 if there was none)."""
    return max((version for version, changes in BREAKING.items() if kind in changes), default=1)


def deprecation(kind: str, declared: int) -> str | None:
    """Why a plugin of ``kind`` written for ``declared`` (already known to load) is deprecated,
    naming the changes since and the fix; ``None`` when it declares the current version."""
    if declared == FD_HOOKSPEC_VERSION:
        return None
    since = [f"version {v}: {ADDITIONS[v]}" for v in range(declared + 1, FD_HOOKSPEC_VERSION + 1) if v in ADDITIONS]
    changes = "; ".join(since) if since else "nothing a plugin implements changed"
    return (f"was written for hookspec version {declared}, which loads until fd-engine {LOADS_UNTIL} "
            f"(since then, {changes}; none of it changes a {kind.replace('_', ' ')} plugin): set "
            f"fd_hookspec_version = {FD_HOOKSPEC_VERSION}")


def refusal(kind: str, declared: object) -> str:
    """Why a plugin of ``kind`` declaring ``declared`` does not load, naming the fix."""
    oldest = oldest_loadable(kind)
    speaks = f"version {oldest}" if oldest == FD_HOOKSPEC_VERSION else f"versions {oldest} to {FD_HOOKSPEC_VERSION}"
    what = "declares no fd_hookspec_version" if declared is None else f"was written for hookspec version {declared!r}"
    if isinstance(declared, int) and 1 <= declared < oldest:
        broke = "; ".join(f"version {v} changed the {kind.replace('_', ' ')} contract: {BREAKING[v][kind]}"
                          for v in range(declared + 1, FD_HOOKSPEC_VERSION + 1) if kind in BREAKING.get(v, {}))
        return (f"{what}; {broke}. Port it (CHANGELOG.md, 'Hookspec version {oldest}') and set "
                f"fd_hookspec_version = {FD_HOOKSPEC_VERSION}")
    return (f"{what}; this core speaks {speaks} for {kind.replace('_', ' ')} plugins "
            f"(set fd_hookspec_version = {FD_HOOKSPEC_VERSION} once the plugin is ported)")


def warn_deprecated(who: str, message: str) -> None:
    """Tell the operator (log) and the plugin's own tests (``warnings``) that ``who`` is deprecated."""
    text = f"{who} {message}"
    log.warning("deprecated: %s", text)
    warnings.warn(text, FdDeprecationWarning, stacklevel=3)
