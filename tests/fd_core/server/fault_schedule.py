"""A randomised fault schedule against real fd-serve instances sharing one real redis-server.

Two deployment shapes (:data:`SHAPES`): ``pool``, three members of the ``global`` scheduler;
``splitwise``, two prefill instances and a decode instance (``zmq`` connector, each behind a
:class:`~tests.fd_core.server.link_cutter.LinkCutter`). A seed draws a plan for a shape: requests
(entry instance, prompt, length, streaming or not, when; every third one constrained by the JSON
schema of :mod:`tests.fd_core.server.constrained`) and a sequence of faults: kill -9 of an
instance (restarted or not), SIGSTOP/SIGCONT of a whole instance for longer than a lease or a
stall timeout, Redis ``CLIENT PAUSE``, a Redis restart (every key lost) and, for splitwise, a cut
connector link (what was in flight on it is lost). :class:`Deployment` runs the plan against real
processes; the checks afterwards:

- every request ended within :data:`REQUEST_BOUND_S` (no hang), answered exactly once;
- with the greedy text of an undisturbed engine (a constrained call: its constrained text, which
  validates), or with an error only where the instance the client talked to was killed while it
  waited (or was down when it asked), or, on the splitwise shape, an error that names the prefill
  side it gave up on;
- every live instance says ``ok`` and has every KV block free;
- no key left in Redis but the live instances' own.

The test module runs a few seeds; many run with
``python -m tests.fd_core.server.fault_schedule --shape pool --seeds 0:50`` (a failing seed is
printed with its plan, so ``--seeds N:N+1`` replays it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import redis

from fd_core.testing.redis_server import RedisServer
from tests.fd_core.server import constrained
from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess, free_port
from tests.fd_core.server.link_cutter import LinkCutter

#: The longest any request may take, faults and recovery included; longer is a hang.
REQUEST_BOUND_S = 120.0
#: Timers: short, so that leases and stall timeouts run out within a plan's span.
HEARTBEAT_S, LEASE_S, SOCKET_TIMEOUT_S, STALL_TIMEOUT_S = 0.2, 1.5, 0.3, 2.0
#: The prompts requests draw from (token ids of the tiny model's vocabulary).
PROMPTS = [[(11 * i + 3 * j) % 480 + 5 for j in range(10 + 3 * i)] for i in range(6)]
MAX_TOKENS = (24, 96)
#: Every GUIDED_EVERY-th call of a plan (in time order) is constrained; marked, not drawn, so that a
#: seed draws the same faults and calls as before constrained calls were added.
GUIDED_EVERY = 3
#: The address the splitwise instances advertise: their link cutters listen there.
CUT_HOST = "127.0.0.2"

FaultKind = Literal["kill", "pause", "redis_pause", "redis_restart", "cut_link"]


@dataclass(frozen=True)
class Shape:
    """A deployment: its instances, the ones clients talk to, those faults may hit, the kinds of
    faults drawn, what an allowed error must name, and how its Redis keys look."""

    name: str
    members: tuple[str, ...]
    entries: tuple[str, ...]
    targets: tuple[str, ...]
    kinds: tuple[FaultKind, ...]
    error_words: tuple[str, ...]          # an error naming one of these is the documented answer
    leftover: Callable[[redis.Redis, set[str]], list[str]]   # keys beyond the live members' own

    def hold_s(self, kind: FaultKind, rng: random.Random) -> float:
        """How long a fault of ``kind`` lasts: pauses outlast a lease (a stall timeout)."""
        outlast = max(LEASE_S, STALL_TIMEOUT_S) if self.name == "splitwise" else LEASE_S
        return {"kill": rng.uniform(0.5, 2.0), "pause": outlast * rng.uniform(1.2, 1.8),
                "redis_pause": rng.uniform(0.3, 2 * LEASE_S), "redis_restart": rng.uniform(0.2, 1.5),
                "cut_link": 0.0}[kind]


#: The key prefix of the pool (``fd:{topic}``, braces included: see ``fd_plugins.schedulers.pool.store``).
POOL_KEYS = "fd:{default}"


def pool_leftover(client: redis.Redis, live: set[str]) -> list[str]:
    """Keys of the pool (:data:`POOL_KEYS`) other than the live members' liveness keys and the
    membership and load sets; members of those sets that are not live."""
    own = {f"{POOL_KEYS}:alive:{name}" for name in live} | {f"{POOL_KEYS}:inst", f"{POOL_KEYS}:load"}
    found = sorted(set(client.scan_iter(f"{POOL_KEYS}:*")) - own)
    for key in (f"{POOL_KEYS}:inst", f"{POOL_KEYS}:load"):
        found += [f"{key} lists {m}" for m in client.zrange(key, 0, -1) if m not in live]
    return found


def directory_leftover(client: redis.Redis, live: set[str]) -> list[str]:
    """Entries of the splitwise directory (``fd:default:sw``) beyond one per live instance (its
    instance ids are drawn at start-up), and listed ids without an entry."""
    entries = set(client.scan_iter("fd:default:sw:peer:*"))
    listed = {f"fd:default:sw:peer:{m}" for m in client.smembers("fd:default:sw:peers")}
    found = [f"{key} (listed: {key in listed})" for key in sorted(entries | listed)] if len(entries) > len(live) else []
    return found + [f"fd:default:sw:peers lists {key} without an entry" for key in sorted(listed - entries)]


POOL = Shape("pool", ("a", "b", "c"), ("a", "b", "c"), ("a", "b", "c"),
             ("kill", "pause", "redis_pause", "redis_restart"), (), pool_leftover)
SPLITWISE = Shape("splitwise", ("p1", "p2", "d"), ("d",), ("p1", "p2", "d"),
                  ("kill", "pause", "redis_pause", "redis_restart", "cut_link"), ("prefill",), directory_leftover)
SHAPES = {shape.name: shape for shape in (POOL, SPLITWISE)}


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` applied to ``target`` at ``at_s`` (from the plan's start) for ``hold_s``
    (the pause, or the time down before a restart; a kill with ``restart=False`` is for good)."""

    at_s: float
    kind: FaultKind
    target: str
    hold_s: float
    restart: bool = True

    def __str__(self) -> str:
        tail = "" if self.kind != "kill" else (", restarted" if self.restart else ", for good")
        return f"{self.at_s:5.2f}s {self.kind} {self.target} for {self.hold_s:.2f}s{tail}"


@dataclass(frozen=True)
class Call:
    """One client request: sent to ``entry`` at ``at_s``."""

    at_s: float
    entry: str
    prompt: int
    max_tokens: int
    stream: bool
    guided: bool = False   # constrained (tests.fd_core.server.constrained): ends with the JSON, not max_tokens

    def body(self) -> dict[str, Any]:
        if self.guided:
            return {**constrained.body(PROMPTS[self.prompt]), "stream": self.stream}
        return {"prompt": PROMPTS[self.prompt], "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": self.stream}

    @property
    def reference_key(self) -> tuple[int, int | str]:
        """Its key in :func:`reference_texts`."""
        return self.prompt, "json" if self.guided else self.max_tokens


@dataclass(frozen=True)
class Plan:
    shape: Shape
    seed: int
    calls: tuple[Call, ...]
    faults: tuple[Fault, ...]

    def describe(self) -> str:
        calls = "\n".join(f"  {c.at_s:5.2f}s -> {c.entry} prompt {c.prompt} max_tokens {c.max_tokens}"
                          f"{' stream' if c.stream else ''}{' json' if c.guided else ''}" for c in self.calls)
        faults = "\n".join(f"  {f}" for f in self.faults)
        return f"{self.shape.name} seed {self.seed}\nfaults:\n{faults}\ncalls:\n{calls}"


def draw_plan(shape: Shape, seed: int, *, calls: int = 18, span_s: float = 8.0) -> Plan:
    """The plan of ``seed`` on ``shape``: 2-3 faults one after another (at most one kill),
    ``calls`` requests spread over ``span_s`` seconds to the shape's entries."""
    rng = random.Random(seed)
    drawn: list[Fault] = []
    at = rng.uniform(0.5, 2.0)
    for _ in range(rng.randint(2, 3)):
        kinds = [k for k in shape.kinds if k != "kill" or not any(f.kind == "kill" for f in drawn)]
        kind = rng.choice(kinds)
        target = "redis" if kind.startswith("redis") else rng.choice(shape.targets)
        hold = shape.hold_s(kind, rng)
        drawn.append(Fault(round(at, 2), kind, target, round(hold, 2), restart=kind != "kill" or rng.random() < 0.6))
        at += hold + rng.uniform(0.5, 2.0)
    requests = sorted((Call(round(rng.uniform(0, span_s), 2), rng.choice(shape.entries),
                            rng.randrange(len(PROMPTS)), rng.choice(MAX_TOKENS), rng.random() < 0.5)
                       for _ in range(calls)), key=lambda c: c.at_s)
    requests = [dataclasses.replace(c, max_tokens=constrained.MAX_TOKENS, guided=True)
                if i % GUIDED_EVERY == GUIDED_EVERY - 1 else c for i, c in enumerate(requests)]
    return Plan(shape, seed, tuple(requests), tuple(drawn))


@dataclass
class Outcome:
    """What one call's client saw."""

    call: Call
    sent: float
    ended: float = 0.0
    text: str | None = None
    error: str | None = None
    finishes: int = 0    # finish reasons received (a complete answer has exactly one)


@dataclass
class Downtime:
    """When a member was killed, and when it answered again (``inf``: never)."""

    killed: float
    back: float = float("inf")


def _timers(redis_url: str) -> str:
    return (f'url = "{redis_url}"\nheartbeat_s = {HEARTBEAT_S}\nlease_s = {LEASE_S}\n'
            f"socket_timeout_s = {SOCKET_TIMEOUT_S}\n")


class Deployment:
    """The instances of a :class:`Shape` (fd-serve processes) on one redis-server, driven by a
    :class:`Plan`. In the pool, ``a`` runs two requests at a time, so peers steal from its queue."""

    def __init__(self, shape: Shape, folder: Path, model: Path, redis_server: RedisServer) -> None:
        self.shape, self.folder, self.model, self.redis = shape, folder, model, redis_server
        self.members: dict[str, ServerProcess | None] = {}
        self.downtimes: dict[str, list[Downtime]] = {name: [] for name in shape.members}
        self.cutters: dict[str, LinkCutter] = {}
        self.t0 = 0.0

    def _config(self, name: str) -> Path:
        path = self.folder / f"{name}.toml"
        if self.shape is POOL:
            extra = "\n[engine]\nmax_num_seqs = 2\n" if name == "a" else ""
            path.write_text(f'[scheduler]\nname = "global"\n[scheduler.options]\n{_timers(self.redis.url)}'
                            f'instance_id = "{name}"\nsteal_min_queued = 1\n{extra}')
        else:
            port = self.cutters[name].target[1]
            role = "decode" if name == "d" else "prefill"
            path.write_text(f'[scheduler]\nname = "splitwise"\n[scheduler.options]\n{_timers(self.redis.url)}'
                            f'[splitwise]\nrole = "{role}"\nheartbeat_s = {HEARTBEAT_S}\n'
                            f"stall_timeout_s = {STALL_TIMEOUT_S}\n"
                            f'[connector]\nname = "zmq"\n[connector.options]\nhost = "127.0.0.1"\nport = {port}\n'
                            f'advertise_host = "{CUT_HOST}"\n')
        return path

    def _spawn(self, name: str) -> ServerProcess:
        args = ["--config", str(self._config(name)), "--model.source", str(self.model), *TINY_ARGS]
        return ServerProcess(args, self.folder / f"{name}-{len(self.downtimes[name])}.log")

    def start(self) -> None:
        if self.shape is SPLITWISE:
            for name in self.shape.members:
                port = free_port()
                self.cutters[name] = LinkCutter((CUT_HOST, port), ("127.0.0.1", port))
        spawned = {name: self._spawn(name) for name in self.shape.members}   # started together
        self.members.update(spawned)
        for server in spawned.values():
            server.wait_ready()

    def stop(self) -> None:
        for server in self.members.values():
            if server is not None:
                server.stop()
        for cutter in self.cutters.values():
            cutter.close()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def live(self) -> dict[str, ServerProcess]:
        return {name: server for name, server in self.members.items() if server is not None}

    # -- faults --------------------------------------------------------------------------------
    def apply(self, fault: Fault) -> None:
        """Apply ``fault`` and return once it is over (the member back, Redis answering)."""
        if fault.kind == "kill":
            self._kill(fault)
        elif fault.kind == "pause":
            self._pause(fault)
        elif fault.kind == "redis_pause":
            with redis.Redis.from_url(self.redis.url) as client:
                client.client_pause(int(fault.hold_s * 1000), all=True)
            time.sleep(fault.hold_s)
        elif fault.kind == "redis_restart":
            self.redis.stop()
            time.sleep(fault.hold_s)
            self.redis.start()
        else:
            self.cutters[fault.target].cut()

    def _pause(self, fault: Fault) -> None:
        server = self.members[fault.target]
        if server is None:
            return
        pids = [server.proc.pid, *server.engine_pids()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(fault.hold_s)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    def _kill(self, fault: Fault) -> None:
        server = self.members[fault.target]
        if server is None:
            return
        downtime = Downtime(self.now())   # before the kill: its clients may hear of it at once
        self.downtimes[fault.target].append(downtime)
        self.members[fault.target] = None
        for pid in server.engine_pids():
            os.kill(pid, signal.SIGKILL)
        server.proc.kill()
        server.stop()
        if fault.restart:
            time.sleep(fault.hold_s)
            restarted = self._spawn(fault.target)
            restarted.wait_ready()
            self.members[fault.target] = restarted
            downtime.back = self.now()

    # -- the workload --------------------------------------------------------------------------
    def run(self, plan: Plan) -> list[Outcome]:
        """Send the plan's calls while its faults happen; every call's outcome."""
        self.t0 = time.monotonic()
        injector = threading.Thread(target=self._inject, args=(plan,), name="faults")
        injector.start()
        with ThreadPoolExecutor(len(plan.calls)) as clients:
            outcomes = list(clients.map(self._call, plan.calls))
        injector.join()
        return outcomes

    def _inject(self, plan: Plan) -> None:
        for fault in plan.faults:
            time.sleep(max(0.0, fault.at_s - self.now()))
            self.apply(fault)

    def _call(self, call: Call) -> Outcome:
        time.sleep(max(0.0, call.at_s - self.now()))
        outcome = Outcome(call, self.now())
        server = self.members[call.entry]
        try:
            if server is None:
                raise httpx.ConnectError(f"{call.entry} is down")
            if call.stream:
                _stream(server.url, call, outcome)
            else:
                _complete(server.url, call, outcome)
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.ended = self.now()
        return outcome


def _complete(url: str, call: Call, outcome: Outcome) -> None:
    response = httpx.post(url + "/v1/completions", json=call.body(), timeout=REQUEST_BOUND_S)
    if response.status_code != 200:
        outcome.error = f"HTTP {response.status_code}: {response.text}"
        return
    choice = response.json()["choices"][0]
    outcome.text, outcome.finishes = choice["text"], int(choice["finish_reason"] is not None)


def _stream(url: str, call: Call, outcome: Outcome) -> None:
    deadline = time.monotonic() + REQUEST_BOUND_S
    with httpx.stream("POST", url + "/v1/completions", json=call.body(), timeout=REQUEST_BOUND_S) as response:
        if response.status_code != 200:
            outcome.error = f"HTTP {response.status_code}: {response.read().decode()}"
            return
        text, done = "", 0
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"the stream ran past {REQUEST_BOUND_S} s")
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    outcome.error = json.dumps(event["error"])
                    continue
                choice = event["choices"][0]
                text += choice["text"]
                outcome.finishes += choice.get("finish_reason") is not None
        outcome.text = text if done == 1 and outcome.error is None else None
        if done != 1 and outcome.error is None:
            outcome.error = f"the stream ended with {done} [DONE] lines"


# -- invariants --------------------------------------------------------------------------------
def answer_violations(outcomes: list[Outcome], reference: dict[tuple[int, int | str], str],
                      downtimes: dict[str, list[Downtime]], error_words: tuple[str, ...]) -> list[str]:
    """Every call answered once with the undisturbed text, or failed only where its instance was
    killed while it waited (or was down when it asked), or with an error naming one of
    ``error_words``."""
    found = []
    for o in outcomes:
        c = o.call
        where = (f"call at {c.at_s}s to {c.entry} (prompt {c.prompt}, {c.max_tokens} tokens, stream={c.stream}, "
                 f"json={c.guided})")
        if o.ended - o.sent > REQUEST_BOUND_S:
            found.append(f"{where} took {o.ended - o.sent:.1f} s")
        if o.error is None:
            if o.text != reference[c.reference_key]:
                found.append(f"{where} answered {o.text!r}, not {reference[c.reference_key]!r}")
            elif o.finishes != 1:
                found.append(f"{where} got {o.finishes} finish reasons")
        elif not (any(d.killed <= o.ended and o.sent <= d.back for d in downtimes[c.entry])
                  or any(word in o.error for word in error_words)):
            found.append(f"{where} failed though its instance lived: {o.error}")
    return found


def block_violations(live: dict[str, ServerProcess], timeout: float = 30.0) -> list[str]:
    """Every live member has every KV block free (waiting up to ``timeout`` for the drain)."""
    from tests.fd_core.server.test_requests import metric, metrics

    found = []
    deadline = time.monotonic() + timeout
    for name, server in live.items():
        while (free := metric(text := metrics(server.url), "fd_kv_cache_blocks_free")) != metric(
                text, "fd_kv_cache_blocks_total"):
            if time.monotonic() > deadline:
                found.append(f"{name}: {free:.0f} of {metric(text, 'fd_kv_cache_blocks_total'):.0f} KV blocks free")
                break
            time.sleep(0.1)
    return found


def key_violations(shape: Shape, redis_url: str, live: set[str], timeout: float = 6 * LEASE_S + 5) -> list[str]:
    """Keys left in Redis beyond the live members' own, once dead members' leases ran out
    (waiting up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        while (found := shape.leftover(client, live)) and time.monotonic() < deadline:
            time.sleep(0.2)
    return [f"left in Redis: {key}" for key in found]


def health_violations(live: dict[str, ServerProcess], timeout: float = 30.0) -> list[str]:
    """Every live member says ``ok`` again (rejoined after a Redis loss)."""
    found = []
    deadline = time.monotonic() + timeout
    for name, server in live.items():
        while (status := httpx.get(server.url + "/health", timeout=10).json()["status"]) != "ok":
            if time.monotonic() > deadline:
                found.append(f"{name} says {status!r} after the plan")
                break
            time.sleep(0.1)
    return found


def reference_texts(model: Path) -> dict[tuple[int, int | str], str]:
    """Greedy text of every (prompt, max_tokens) and (prompt, "json"), constrained, from one
    undisturbed offline engine (the constrained texts validate)."""
    from fd_core.engine.llm import LLM
    from fd_core.request import SamplingParams

    llm = LLM(str(model), cache={"num_blocks": 256})
    texts: dict[tuple[int, int | str], str] = {}
    for max_tokens in MAX_TOKENS:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        texts.update(((i, max_tokens), r.text) for i, r in enumerate(llm.generate(PROMPTS, params)))
    texts.update(((i, "json"), text) for i, text in enumerate(constrained.references(llm, PROMPTS)))
    return texts


@dataclass
class Result:
    plan: Plan
    violations: list[str] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> str:
        exact = sum(o.error is None for o in self.outcomes)
        return f"{exact} of {len(self.outcomes)} answered exactly, {len(self.outcomes) - exact} with an error"

    def report(self) -> str:
        errors = "\n".join(f"  {o.call.entry} at {o.sent:.2f}s: {o.error}" for o in self.outcomes if o.error)
        return (f"{self.plan.describe()}\nerrors:\n{errors or '  none'}\n"
                f"violations:\n" + "\n".join(f"  {v}" for v in self.violations))


@contextmanager
def running(shape: Shape, folder: Path, model: Path) -> Iterator[Deployment]:
    redis_server = RedisServer(folder / "redis").start()
    deployment = Deployment(shape, folder, model, redis_server)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()
        redis_server.stop()


def run_seed(shape: Shape, seed: int, folder: Path, model: Path, reference: dict[tuple[int, int | str], str]) -> Result:
    """Run the plan of ``seed`` on a fresh deployment of ``shape`` in ``folder``; its violations
    (none: it passed)."""
    plan = draw_plan(shape, seed)
    result = Result(plan)
    with running(shape, folder, model) as deployment:
        result.outcomes = deployment.run(plan)
        live = deployment.live()
        checks: list[Callable[[], list[str]]] = [
            lambda: answer_violations(result.outcomes, reference, deployment.downtimes, shape.error_words),
            lambda: health_violations(live), lambda: block_violations(live),
            lambda: key_violations(shape, deployment.redis.url, set(live))]
        for check in checks:
            result.violations += check()
        if shape is SPLITWISE and deployment.cutters["d"].accepted == 0:   # the prefill side's KV goes through it
            result.violations.append("no connection went through the decode instance's link cutter")
    return result


def main() -> None:
    from fd_core.testing.tiny_model import make_tiny_llama

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="pool")
    parser.add_argument("--seeds", default="0:10", help="a range START:STOP of seeds")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/fd-fault-schedule"))
    args = parser.parse_args()
    start, stop = map(int, args.seeds.split(":"))
    args.folder.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(args.folder / "model", vocab=512, max_position_embeddings=512)
    reference = reference_texts(model)
    failed = []
    for seed in range(start, stop):
        result = run_seed(SHAPES[args.shape], seed, args.folder / f"{args.shape}-{seed}", model, reference)
        print(f"{args.shape} seed {seed}: {'ok' if not result.violations else 'FAILED'} ({result.summary()})",
              flush=True)
        if result.violations:
            failed.append(seed)
            print(result.report(), flush=True)
    print(f"{stop - start - len(failed)} of {stop - start} seeds passed; failed: {failed}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
