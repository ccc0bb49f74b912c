"""Fair sharing of the engine's ``max_num_seqs`` slots between client calls.

A client call with ``n`` choices reaches the engine as ``n`` sibling requests sharing
``Request.group_id`` (``Request.call_id``; a request without one is a call of its own); each
holds one of the ``max_num_seqs`` slots while the resource manager has it, for as long as it
decodes. Without a rule, one call with ``n >= max_num_seqs`` and long outputs holds every slot
for its whole length, and any other request waits that long (issue 41 item 20).

The rule (``engine.fair_share``, on by default). A call's *share* is ``max_num_seqs // G``
(at least 1), ``G`` being the number of calls holding a slot, counting the call asking for
one. When every slot is taken and a request arrives whose call holds fewer slots than its
share, the call holding the most slots gives one up if it holds more than its share: its
sequence with the least computed work (the latest admitted among equals) gives its KV blocks
back and is *parked* in the engine; it keeps its output tokens and resumes later by recomputing
them, as after a preemption, so its output is the same as undisturbed. A request whose call
already holds its share is parked before it starts. When a slot frees, parked requests of calls
under their share resume first, then the scheduler hands out new requests, then the other parked
requests resume (of the call holding fewest slots first; started ones first, then by the time
they were parked). The bound this gives a waiting request, in engine steps, is stated in
docs/architecture.md ("Fair sharing").

The rule bites only when one call holds more than its share while another call waits: requests
of one sequence each never take a slot from one another (each holds 1, and a share is at least 1).
A call giving up a slot keeps at least its share, so two calls never take slots back and forth.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from fd_core.request import RequestStatus

if TYPE_CHECKING:
    from fd_core.request import Request


class FairShare:
    """The requests the core gave a slot (and may take it back from) and the requests it parked.

    Engine thread only. ``holding`` and ``parked`` never share a request; the core removes a
    request from both when it ends (:meth:`forget`).
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.holding: dict[str, Request] = {}   # id -> request holding a slot, in order of admission
        self.parked: dict[str, Request] = {}    # id -> request holding none, in order of parking

    def hold(self, request: Request) -> None:
        """``request`` got a slot (it went to the resource manager)."""
        self.parked.pop(request.request_id, None)
        self.holding[request.request_id] = request

    def park(self, request: Request) -> None:
        """``request`` waits in the engine without a slot (taken back, or not started)."""
        self.holding.pop(request.request_id, None)
        self.parked[request.request_id] = request

    def forget(self, request_id: str) -> None:
        """The request ended."""
        self.holding.pop(request_id, None)
        self.parked.pop(request_id, None)

    def num_calls(self) -> int:
        """Calls with a request holding a slot or parked."""
        return len({r.call_id for r in (*self.holding.values(), *self.parked.values())})

    def share(self, call: str, slots: Counter[str]) -> int:
        """Slots each call may keep while ``call`` asks for one, given the slots each call holds."""
        num_calls = len(slots) + (call not in slots)
        return max(1, self.max_num_seqs // num_calls)

    def over_share(self) -> bool:
        """Whether a call holds more slots than it would keep if one more call asked for one:
        only then can a request waiting in the scheduler get a slot while every slot is taken."""
        slots = self._slots()
        return bool(slots) and max(slots.values()) > max(1, self.max_num_seqs // (len(slots) + 1))

    def donor_for(self, request: Request) -> Request | None:
        """The request that gives its slot to ``request`` when every slot is taken, or None when
        ``request``'s call holds its share already or no call holds more than its own."""
        slots = self._slots()
        call = request.call_id
        share = self.share(call, slots)
        if slots[call] >= share or not slots:
            return None
        richest, most = max(slots.items(), key=lambda item: item[1])
        if most <= share:
            return None
        members = [r for r in reversed(self.holding.values()) if r.call_id == richest]
        return min(members, key=lambda r: r.num_computed_tokens)

    def next_to_resume(self, *, under_share_only: bool) -> Request | None:
        """The parked request to give the next free slot: of the call holding fewest slots, started
        ones first, then the earliest parked; with ``under_share_only``, only if that call holds
        fewer than its share."""
        if not self.parked:
            return None
        slots = self._slots()
        order = {request_id: index for index, request_id in enumerate(self.parked)}
        best = min(self.parked.values(), key=lambda r: (slots[r.call_id], r.status is not RequestStatus.PREEMPTED,
                                                        order[r.request_id]))
        call = best.call_id
        if under_share_only and slots[call] >= self.share(call, slots):
            return None
        return best

    def _slots(self) -> Counter[str]:
        return Counter(r.call_id for r in self.holding.values())
