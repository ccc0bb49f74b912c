"""Conformance kit for speculative proposers: proposals fit budgets and vocabulary, and follow from the tokens.

Use it from a proposer's own pytest::

    from fd_core.testing.conformance import check_proposer

    def test_my_proposer_conforms():
        check_proposer(MyProposer)

The proposer is built as the engine builds it (``cls(settings, max_proposed_tokens=...,
vocab_size=VOCAB_SIZE)``) and driven over the kit's requests: seeded token sequences over the whole
vocabulary that copy spans of themselves (so a proposer that looks back finds matches), from one
token to :data:`LONGEST`, every other one arriving with outputs already (a continuation). A
simulated engine plays the steps: each request has a known future; a proposal is accepted up to
its first token that differs from it, and the request grows by the accepted tokens and one more,
as a verified run does. Not every request decodes every step, some end half-way (``forget``) and
new ones come. See :data:`PROPOSER_CHECKS` for the invariants.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from fd_core.request import Request, RequestStatus, SamplingParams
from fd_core.testing.conformance._factories import plugin_settings
from fd_core.testing.conformance._report import Check, ConformanceError, SeamReport, broken, run_checks

if TYPE_CHECKING:
    from fd_core.contracts.proposer import Proposer

__all__ = ["PROPOSER_CHECKS", "check_proposer", "run_proposer_checks"]

SEAM: Final = "proposer"

SHAPE: Final = "one list per request, at most its budget long"
TOKENS: Final = "proposed ids are ints in [0, vocab_size)"
EMPTY: Final = "no requests, and a request of one token, are answered"
DETERMINISTIC: Final = "the same calls give the same proposals"
REBUILDS: Final = "without observe(), proposals depend on the tokens alone, however they came"
UNCHANGED: Final = "propose, observe and forget leave the requests as they were"
UNKNOWN: Final = "observe() and forget() take requests never proposed for, or forgotten"

#: The vocabulary the proposer is built with; the kit's tokens use all of it, the last id too.
VOCAB_SIZE: Final = 1000
#: ``max_proposed_tokens`` of the budget check's proposers; the other checks use the middle one.
MOST: Final = (1, 4, 16)
#: The kit's request lengths (prompt and outputs), cycled; every other request arrives with outputs.
LENGTHS: Final = (1, 2, 3, 9, 40, 200, 900, 3000)
LONGEST: Final = max(LENGTHS)
NUM_REQUESTS: Final = 24
STEPS: Final = 12
#: Seeds of the simulated runs.
SEEDS: Final = (0, 1)


def check_proposer(cls: type[Proposer], *, options: Mapping[str, Any] | None = None,
                   skip: Collection[str] = ()) -> SeamReport:
    """Run every proposer check; return the report, or raise ConformanceError naming the broken invariants."""
    return run_proposer_checks(cls, options=options, skip=skip).raise_for_failures()


def run_proposer_checks(cls: type[Proposer], *, options: Mapping[str, Any] | None = None,
                        skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_proposer`, but never raises for a broken invariant: every check gets a row.
    Bad options raise pydantic's ValidationError (or ValueError)."""
    settings = plugin_settings(cls, options)
    return run_checks(SEAM, cls.__name__, PROPOSER_CHECKS, skip=skip, args=(_Kit(cls, settings),))


@dataclass(frozen=True, slots=True)
class _Kit:
    """How to build the proposer under test."""

    cls: type[Proposer]
    settings: Any

    def build(self, most: int = MOST[1]) -> Proposer:
        return self.cls(self.settings, max_proposed_tokens=most, vocab_size=VOCAB_SIZE)


@dataclass(slots=True)
class _Case:
    """A kit request and the tokens the simulated model gives it next."""

    request: Request
    future: list[int]


#: Called after each propose of a run: (requests, budgets, proposals, where) -> raises on a broken rule.
Inspect = Callable[[Sequence[Request], Sequence[int], list[list[int]], str], None]


def _sequence(rng: random.Random, length: int) -> list[int]:
    """``length`` tokens, about half of them copies of earlier spans of 4 to 16 tokens."""
    tokens: list[int] = []
    while len(tokens) < length:
        if len(tokens) >= 8 and rng.random() < 0.5:
            start = rng.randrange(len(tokens) - 4)
            tokens.extend(tokens[start:start + rng.randint(4, 16)])
        else:
            tokens.extend(rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 8)))
    return tokens[:length]


def _case(rng: random.Random, request_id: str, length: int, *, continued: bool) -> _Case:
    tokens = _sequence(rng, length + STEPS * (max(MOST) + 1))
    prompt_len = max(1, length * 2 // 3) if continued else length
    request = Request(request_id, tokens[:prompt_len], SamplingParams(max_tokens=4096, temperature=0.0),
                      output_token_ids=tokens[prompt_len:length], status=RequestStatus.RUNNING,
                      num_computed_tokens=length - 1)
    return _Case(request, tokens[length:])


def _cases(seed: int, prefix: str = "r") -> list[_Case]:
    rng = random.Random(seed)
    return [_case(rng, f"{prefix}{i}", LENGTHS[i % len(LENGTHS)], continued=i % 2 == 1) for i in range(NUM_REQUESTS)]


def _where(seed: int, step: int, most: int) -> str:
    return f"seed {seed}, step {step}, max_proposed_tokens {most}"


def _propose(proposer: Proposer | _Watched, requests: Sequence[Request], budgets: Sequence[int],
             where: str) -> list[list[int]]:
    """``proposer.propose``, its answer's shape checked (every run needs it to go on)."""
    name = proposer.label if isinstance(proposer, _Watched) else type(proposer).__name__
    proposals = proposer.propose(requests, budgets)
    if not isinstance(proposals, list) or len(proposals) != len(requests):
        size = len(proposals) if isinstance(proposals, Sequence) else "no"
        raise broken(SEAM, SHAPE, f"{name}.propose() for {len(requests)} requests returned {type(proposals).__name__} "
                                  f"of {size} entries ({where})")
    for request, budget, proposal in zip(requests, budgets, proposals, strict=True):
        if not isinstance(proposal, list) or len(proposal) > budget:
            got = f"{len(proposal)} tokens" if isinstance(proposal, Sequence) else type(proposal).__name__
            raise broken(SEAM, SHAPE, f"{name} proposed {got} for request {request.request_id!r} with a budget of "
                                      f"{budget}: {proposal!r:.120} ({where})")
    return proposals


def _accepted(proposal: list[int], future: list[int]) -> int:
    """How many of ``proposal``'s first tokens equal the model's next ones (greedy verification)."""
    count = 0
    while count < len(proposal) and count < len(future) and proposal[count] == future[count]:
        count += 1
    return count


def _grow(case: _Case, count: int) -> None:
    """The request gains its next ``count`` tokens, all computed but the last."""
    case.request.output_token_ids.extend(case.future[:count])
    del case.future[:count]
    case.request.num_computed_tokens = case.request.num_tokens - 1


def _run(proposer: Proposer | _Watched, seed: int, most: int = MOST[1], *, observe: bool = True,
         inspect: Inspect | None = None, cases: list[_Case] | None = None) -> list[tuple[str, list[int]]]:
    """Play :data:`STEPS` steps of the simulated engine; every proposal, in order, as (request id, tokens).

    A request sits out one step in five (it decodes without a proposal, one token); at the middle
    step the first three requests end (``forget``) and three others arrive, with outputs already.
    """
    cases = _cases(seed) if cases is None else cases
    rng = random.Random(seed + len(SEEDS))   # the late requests' tokens: other than the first ones'
    log: list[tuple[str, list[int]]] = []
    for step in range(STEPS):
        if step == STEPS // 2:
            for case in cases[:3]:
                proposer.forget(case.request.request_id)
            cases[:3] = [_case(rng, f"late{seed}-{i}", LENGTHS[-1 - i], continued=True) for i in range(3)]
        decoding = [case for i, case in enumerate(cases) if (i + step) % 5]
        sitting = [case for i, case in enumerate(cases) if not (i + step) % 5]
        budgets = [1 + (i * 7 + step) % most for i in range(len(decoding))]
        where = _where(seed, step, most)
        requests = [case.request for case in decoding]
        proposals = _propose(proposer, requests, budgets, where)
        if inspect is not None:
            inspect(requests, budgets, proposals, where)
        for case, proposal in zip(decoding, proposals, strict=True):
            log.append((case.request.request_id, proposal))
            accepted = _accepted(proposal, case.future)
            if observe:
                proposer.observe(case.request, len(proposal), accepted)
            _grow(case, accepted + 1)
        for case in sitting:
            _grow(case, 1)
    return log


def _budgets(kit: _Kit) -> None:
    for most in MOST:
        for seed in SEEDS:
            _run(kit.build(most), seed, most)


def _token_ids(kit: _Kit) -> None:
    def inspect(requests: Sequence[Request], budgets: Sequence[int], proposals: list[list[int]], where: str) -> None:
        for request, proposal in zip(requests, proposals, strict=True):
            for token in proposal:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < VOCAB_SIZE:
                    raise broken(SEAM, TOKENS, f"{kit.cls.__name__} proposed {token!r} ({type(token).__name__}) for "
                                               f"request {request.request_id!r}; vocab_size is {VOCAB_SIZE} ({where})")

    for seed in SEEDS:
        _run(kit.build(max(MOST)), seed, max(MOST), inspect=inspect)


def _empty(kit: _Kit) -> None:
    proposer = kit.build()
    name = kit.cls.__name__
    answer = proposer.propose([], [])
    if answer != []:
        raise broken(SEAM, EMPTY, f"{name}.propose([], []) returned {answer!r:.120}, not []")
    rng = random.Random(0)
    for case in (_case(rng, "one", 1, continued=False), _case(rng, "two", 2, continued=True)):
        _propose(proposer, [case.request], [MOST[1]], f"a request of {case.request.num_tokens} token(s)")


def _deterministic(kit: _Kit) -> None:
    for seed in SEEDS:
        first, second = _run(kit.build(), seed), _run(kit.build(), seed)
        for index, (one, other) in enumerate(zip(first, second, strict=True)):
            if one != other:
                raise broken(SEAM, DETERMINISTIC, f"two fresh {kit.cls.__name__} given the same calls differ at "
                                                  f"proposal {index} (seed {seed}): request {one[0]!r} got "
                                                  f"{one[1]!r:.80}, then {other[1]!r:.80}")


def _rebuilds(kit: _Kit) -> None:
    """A proposer that watched the requests grow, then saw them changed, then forgot them, proposes
    what a fresh one does for the same requests (which it sees as continuations)."""
    seed = SEEDS[0]
    watched = kit.build()
    cases = _cases(seed)
    _run(watched, seed, observe=False, cases=cases)
    requests = [case.request for case in cases]
    _same_as_fresh(kit, watched, requests, "after watching the requests grow step by step")
    for index, request in enumerate(requests):   # the same ids, tokens that do not extend those seen
        change = index % 3
        if change == 0 and request.output_token_ids:
            del request.output_token_ids[-3:]    # cut back
        elif change == 1:
            request.prompt_token_ids[len(request.prompt_token_ids) // 2] = (index * 37) % VOCAB_SIZE
        else:
            request.prompt_token_ids = list(requests[(index + 1) % len(requests)].prompt_token_ids)
        request.num_computed_tokens = request.num_tokens - 1
    _same_as_fresh(kit, watched, requests, "after their tokens changed (outputs cut back, a prompt token "
                                           "changed, a prompt replaced) under the same request ids")
    for request in requests:
        watched.forget(request.request_id)
    for request, other in zip(requests, _cases(seed + 1), strict=True):   # ids come back with other tokens
        request.prompt_token_ids = list(other.request.prompt_token_ids)
        request.output_token_ids = list(other.request.output_token_ids)
        request.num_computed_tokens = request.num_tokens - 1
    _same_as_fresh(kit, watched, requests, "after forget() and the same request ids coming back with other tokens")


def _same_as_fresh(kit: _Kit, watched: Proposer, requests: list[Request], when: str) -> None:
    budgets = [MOST[1]] * len(requests)
    seen = _propose(watched, requests, budgets, when)
    fresh = _propose(kit.build(), requests, budgets, f"a fresh proposer, {when}")
    for request, one, other in zip(requests, seen, fresh, strict=True):
        if one != other:
            raise broken(SEAM, REBUILDS, f"{kit.cls.__name__} proposed {one!r:.80} for request "
                                         f"{request.request_id!r} ({request.num_tokens} tokens) {when}; a fresh one "
                                         f"proposes {other!r:.80}")


def _snapshot(request: Request) -> dict[str, Any]:
    """Every field's value; lists are copied shallowly (the kit's hold ints, or nothing)."""
    return {f.name: (list(value) if isinstance(value, list) else copy.deepcopy(value))
            for f in dataclasses.fields(request) for value in [getattr(request, f.name)]}


class _Watched:
    """Forwards every call to the proposer, checking that requests come back unchanged: every kit
    request around ``propose`` and ``forget``, the one it names around ``observe``."""

    def __init__(self, proposer: Proposer, cases: list[_Case]) -> None:
        self._proposer = proposer
        self._cases = cases
        self.label = type(proposer).__name__

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        return self._unchanged(f"propose() for {len(requests)} requests", self._everyone(),
                               lambda: self._proposer.propose(requests, budgets))

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self._unchanged(f"observe({request.request_id!r}, {num_proposed}, {num_accepted})", [request],
                        lambda: self._proposer.observe(request, num_proposed, num_accepted))

    def forget(self, request_id: str) -> None:
        self._unchanged(f"forget({request_id!r})", self._everyone(), lambda: self._proposer.forget(request_id))

    def _everyone(self) -> list[Request]:
        return [case.request for case in self._cases]

    def _unchanged(self, call: str, requests: list[Request], run: Callable[[], Any]) -> Any:
        before = [(request, _snapshot(request)) for request in requests]
        answer = run()
        for request, snapshot in before:
            after = _snapshot(request)
            changed = sorted(key for key in snapshot if snapshot[key] != after[key])
            if changed:
                raise broken(SEAM, UNCHANGED, f"{self.label}.{call} changed request {request.request_id!r}: "
                                              f"{', '.join(changed)}")
        return answer


def _unchanged(kit: _Kit) -> None:
    seed = SEEDS[0]
    cases = _cases(seed)
    _run(_Watched(kit.build(), cases), seed, cases=cases)


def _unknown_ids(kit: _Kit) -> None:
    proposer = kit.build()
    case = _cases(SEEDS[0])[5]
    request = case.request
    calls: list[tuple[str, Callable[[], Any]]] = [
        (f"observe({request.request_id!r}, 3, 2) before any propose", lambda: proposer.observe(request, 3, 2)),
        (f"observe({request.request_id!r}, 0, 0)", lambda: proposer.observe(request, 0, 0)),
        ("forget('never-proposed')", lambda: proposer.forget("never-proposed")),
        ("propose() for it", lambda: _propose(proposer, [request], [MOST[1]], "after observe() of it")),
        (f"forget({request.request_id!r})", lambda: proposer.forget(request.request_id)),
        (f"forget({request.request_id!r}) again", lambda: proposer.forget(request.request_id)),
        (f"observe({request.request_id!r}, 2, 1) after forget()", lambda: proposer.observe(request, 2, 1)),
        ("propose() for it again", lambda: _propose(proposer, [request], [MOST[1]], "after forget() of it")),
    ]
    for call, run in calls:
        try:
            run()
        except ConformanceError:   # the proposal's shape: reported as it is
            raise
        except Exception as exc:
            raise broken(SEAM, UNKNOWN, f"{kit.cls.__name__}.{call} raised {type(exc).__name__}: {exc}") from None


PROPOSER_CHECKS: Final = (
    Check("budgets", SHAPE, _budgets),
    Check("token_ids", TOKENS, _token_ids),
    Check("empty", EMPTY, _empty),
    Check("deterministic", DETERMINISTIC, _deterministic),
    Check("rebuilds", REBUILDS, _rebuilds),
    Check("unchanged", UNCHANGED, _unchanged),
    Check("unknown_ids", UNKNOWN, _unknown_ids),
)
