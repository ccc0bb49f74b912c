"""What every seam's kit shares: the error naming a broken invariant, per-check results, the runner.

A seam's kit is a tuple of :class:`Check` (a short name, the invariant it guards in words, and a
function). :func:`run_checks` runs each one independently (a broken plugin fails one row, the
others still run) and returns a :class:`SeamReport`; ``check_<seam>`` raises
:meth:`SeamReport.raise_for_failures` on top. Inside a check, :func:`broken` makes the error to
raise; anything else the plugin raises fails that check with the exception named.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

#: Statuses of one check.
PASSED: Final = "passed"
FAILED: Final = "failed"
SKIPPED: Final = "skipped"
Status = Literal["passed", "failed", "skipped"]


class ConformanceError(AssertionError):
    """A plugin broke its seam's contract; the message names the invariant and what was seen.

    ``seam`` and ``invariant`` are set by every kit except ``check_resource_manager``'s older
    messages, which name the seed, the step and the rule.
    """

    def __init__(self, message: str, *, seam: str | None = None, invariant: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.seam = seam
        self.invariant = invariant
        self.detail = message if detail is None else detail   # what was seen, without the invariant


class Skip(Exception):
    """Raised inside a check that does not apply to this plugin (the message says why)."""


def broken(seam: str, invariant: str, detail: str) -> ConformanceError:
    """``<seam> invariant '<invariant>' broken: <detail>``, ready to raise."""
    return ConformanceError(f"{seam.replace('_', ' ')} invariant {invariant!r} broken: {detail}",
                            seam=seam, invariant=invariant, detail=detail)


@dataclass(frozen=True, slots=True)
class Check:
    """One row of a seam's kit."""

    name: str                        # short id, e.g. "exactly_once" (``--skip`` takes it)
    invariant: str                   # the invariant in words, as failure messages name it
    run: Callable[..., None]         # raises ConformanceError (or Skip); its arguments are the kit's


@dataclass(frozen=True, slots=True)
class CheckResult:
    """How one check went."""

    check: str
    invariant: str
    status: Status
    reason: str = ""       # the failure message (naming the invariant), or why it was skipped; "" when it passed
    seconds: float = 0.0   # wall time the check took
    detail: str = ""       # the failure message without the invariant's name (what was seen)

    @property
    def passed(self) -> bool:
        return self.status == PASSED


@dataclass(frozen=True, slots=True)
class SeamReport:
    """Every check of one seam's kit against one plugin."""

    seam: str
    plugin: str                       # what was checked, e.g. "LocalScheduler"
    results: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        """No check failed (skipped ones do not count against it)."""
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAILED]

    def result(self, check: str) -> CheckResult:
        """The result of the check named ``check``."""
        return next(r for r in self.results if r.check == check)

    def raise_for_failures(self) -> SeamReport:
        """Raise ConformanceError for the failed checks (the first one's invariant); else return self."""
        failures = self.failures
        if not failures:
            return self
        first = failures[0]
        lines = [first.reason] + [f"also: {r.reason}" for r in failures[1:]]
        raise ConformanceError("\n".join(lines), seam=self.seam, invariant=first.invariant)


def run_checks(seam: str, plugin: str, checks: Iterable[Check], *, skip: Collection[str] = (),
               args: tuple[Any, ...] = ()) -> SeamReport:
    """Run every check with ``args``; a check named in ``skip`` is reported skipped, not run."""
    results = []
    known = {check.name for check in checks}
    unknown = sorted(set(skip) - known)
    if unknown:
        raise ValueError(f"no {seam} check named {', '.join(unknown)}; the checks are {', '.join(sorted(known))}")
    for check in checks:
        if check.name in skip:
            results.append(CheckResult(check.name, check.invariant, SKIPPED, "skipped on request", 0.0,
                                       "skipped on request"))
            continue
        results.append(run_one(seam, check, args))
    return SeamReport(seam, plugin, tuple(results))


def run_one(seam: str, check: Check, args: tuple[Any, ...]) -> CheckResult:
    """Run one check: ConformanceError and any plugin exception fail it, Skip skips it."""
    started = time.monotonic()
    try:
        check.run(*args)
    except Skip as exc:
        return CheckResult(check.name, check.invariant, SKIPPED, str(exc), time.monotonic() - started, str(exc))
    except ConformanceError as exc:
        return CheckResult(check.name, exc.invariant or check.invariant, FAILED, str(exc), time.monotonic() - started,
                           exc.detail or str(exc))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # the plugin raised where the contract says it answers
        error = broken(seam, check.invariant, f"the plugin raised {type(exc).__name__}: {exc}")
        return CheckResult(check.name, check.invariant, FAILED, str(error), time.monotonic() - started,
                           error.detail or "")
    return CheckResult(check.name, check.invariant, PASSED, "", time.monotonic() - started)


def wait_until(condition: Callable[[], bool], timeout: float, poll: Callable[[], None] | None = None,
               interval: float = 0.01) -> bool:
    """Call ``poll`` (if any) and test ``condition`` until it holds or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        if poll is not None:
            poll()
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        if poll is None:
            time.sleep(interval)
