"""How the engine core takes part in hand-offs: one interface, a no-op for mixed instances.

The core calls these from its loop (the engine thread), in this order per step: :meth:`poll`
(new prefill requests, first tokens, requests to end), :meth:`admit` for each request the
scheduler handed out, :meth:`planned` once the resource manager planned the step,
:meth:`computed` once the model ran it (before the token processor), and :meth:`forget` for
every request the core ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from fd_core.outputs import SampledToken, StepPlan, StepResult
    from fd_core.request import FinishReason, Request


@dataclass(slots=True)
class HandoffEvents:
    """What the hand-off asks of the core at the start of a step."""

    new_requests: list[Request] = field(default_factory=list)   # prefill side: compute these, route nothing
    first_tokens: list[tuple[Request, SampledToken]] = field(default_factory=list)   # decode: KV arrived
    ends: list[tuple[Request, FinishReason, str | None]] = field(default_factory=list)


class EngineHandoff:
    """The mixed role: no hand-offs. The prefill and decode sides override what they need."""

    role: ClassVar[str] = "mixed"
    name: ClassVar[str] = "splitwise"   # how failures name it (fd_core.plugin_guard.plugin_label)

    def __repr__(self) -> str:
        return f"<{self.role} hand-off>"

    def start(self, wake_engine: Callable[[], None]) -> None:
        """Begin taking part (bind, publish this instance); ``wake_engine`` wakes an idle loop."""

    def poll(self, room: int) -> HandoffEvents:
        """What arrived since the last step; at most ``room`` new requests."""
        return HandoffEvents()

    def admit(self, request: Request) -> bool:
        """Take a request the scheduler handed out (True), or leave it to the resource manager."""
        return False

    def planned(self, plan: StepPlan) -> None:
        """The step's plan is made (and preemptions done), before the model runs it."""

    def computed(self, plan: StepPlan, result: StepResult) -> None:
        """The model ran the plan; may take sampled tokens out of ``result`` (they are shipped)."""

    def forget(self, request_id: str) -> None:
        """The core ended this request; drop (and abort) any hand-off of it."""

    def holds(self, request_id: str) -> bool:
        """True while the request's KV is being shipped: it ends only through the hand-off then
        (a failed step does not end it; it needs no more compute)."""
        return False

    def has_events(self) -> bool:
        """True when :meth:`poll` has something (so the loop must not sleep)."""
        return False

    def stats(self) -> dict[str, Any]:
        """Counters for ``/metrics`` (``fd_splitwise_*``)."""
        return {}

    def close(self) -> None:
        """Stop the hand-off thread and the connector."""


MIXED = EngineHandoff()
