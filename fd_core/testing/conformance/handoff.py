"""The connector kit's hand-off checks: a mixed, a prefill and a decode tiny engine, in one process.

The engines are built the way ``fd-serve`` builds them (:func:`fd_core.engine.builder.build_engine`)
from a tiny random model (:func:`fd_core.testing.tiny_model.make_tiny_llama`) and the installed
``v1`` resource manager, ``default`` token processor and ``cpu`` platform; the prefill and decode
engines use the connector under test and an in-memory peer directory
(:mod:`.peer_directory`) instead of Redis. Each is stepped by hand, as
``tests/fd_core/splitwise/test_handoff.py`` does.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any, Final

from fd_core.request import Request, SamplingParams
from fd_core.testing.conformance._report import Check, broken, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable

    from fd_core.contracts.connector import Connector
    from fd_core.engine.core import EngineCore
    from fd_core.outputs import RequestOutput

__all__ = ["HANDOFF_CHECKS", "HandoffRig"]

SEAM: Final = "connector"
#: The name the connector under test is registered as in the kit's engines.
CONNECTOR_NAME: Final = "under-test"
#: Prompts of the hand-off check (token ids of the tiny model): several blocks, one block, many.
PROMPTS: Final = ([5, 17, 42, 99, 7, 3, 250, 31] * 3, [11, 12, 13], list(range(40, 90)))
#: Longest a hand-off of the tiny model may take on loopback.
PATIENCE_S: Final = 60.0
#: Longest the blocks may take to be free on both ends after a hand-off ended.
FREE_WITHIN_S: Final = 10.0
_BLOCK_SIZE: Final = 8
_NUM_BLOCKS: Final = 64

HANDOFF: Final = "a prefill -> decode hand-off gives the mixed engine's output"
FREES: Final = "both ends free every block once hand-offs end"
ABORT_FREES: Final = "an abort on the decode side frees the prefill side"


class HandoffRig:
    """The three engines, built on first use and closed by :meth:`close`."""

    def __init__(self, factory: Callable[[Any, str, str], Connector], settings: Any, *,
                 model_dir: str | None = None) -> None:
        self.factory = factory
        self.settings = settings
        self.model_dir = model_dir
        self._made_dir: str | None = None
        self._engines: tuple[EngineCore, EngineCore, EngineCore] | None = None
        self._built: list[EngineCore] = []
        self._error: BaseException | None = None

    def __enter__(self) -> HandoffRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def engines(self) -> tuple[EngineCore, EngineCore, EngineCore]:
        """(mixed, prefill, decode); a failure to build them is raised again at every call."""
        if self._error is not None:
            raise self._error
        if self._engines is None:
            try:
                self._engines = self._build()
            except BaseException as exc:
                self._error = exc
                raise
        return self._engines

    def close(self) -> None:
        for engine in reversed(self._built):
            engine.close()
        self._built.clear()
        if self._made_dir is not None:
            shutil.rmtree(self._made_dir, ignore_errors=True)
            self._made_dir = None

    def _build(self) -> tuple[EngineCore, EngineCore, EngineCore]:
        from fd_core.config import load_config
        from fd_core.engine.builder import build_engine
        from fd_core.registry import Registry
        from fd_core.testing.conformance.peer_directory import (
            DIRECTORY_NAME,
            directory_scheduler,
        )

        if self.model_dir is None:
            from fd_core.testing.tiny_model import make_tiny_llama

            self._made_dir = tempfile.mkdtemp(prefix="fd-conformance-model-")
            self.model_dir = str(make_tiny_llama(self._made_dir, layers=2, vocab=512, max_position_embeddings=512))
        installed = Registry.discover()
        classes = {seam: [installed.load(seam, name)] for seam, name in
                   (("resource_manager", "v1"), ("token_processor", "default"), ("platform", "cpu"))}
        classes["scheduler"] = [directory_scheduler(installed.load("scheduler", "local"))]
        classes["connector"] = [_as_plugin_class(self.factory, self.settings)]
        for role in ("mixed", "prefill", "decode"):
            sections: dict[str, Any] = {
                "model": {"source": self.model_dir},
                "cache": {"num_blocks": _NUM_BLOCKS, "block_size": _BLOCK_SIZE},
                "scheduler": {"name": DIRECTORY_NAME}, "resource_manager": {"name": "v1"},
                "token_processor": {"name": "default"}, "platform": {"name": "cpu"}}
            if role != "mixed":
                sections["splitwise"] = {"role": role, "heartbeat_s": 0.1, "stall_timeout_s": 1.0}
                sections["connector"] = {"name": CONNECTOR_NAME}
            # a registry per engine: the prefill side registers its own hook implementation in it
            self._built.append(build_engine(load_config(**sections), Registry.from_plugins(classes)))
        mixed, prefill, decode = self._built
        return mixed, prefill, decode


def _as_plugin_class(factory: Callable[[Any, str, str], Connector], settings: Any) -> type[Connector]:
    """A Connector class whose construction is ``factory(settings, role, instance_id)``, so the
    engine builder can select it by name like an installed connector."""
    from fd_core.contracts.connector import Connector
    from fd_core.hookspecs import FD_HOOKSPEC_VERSION

    def __new__(cls: type, _settings: Any, *, role: str, instance_id: str) -> Connector:
        return factory(settings, role, instance_id)   # not an instance of cls: __init__ is not called

    return type("ConnectorUnderTest", (Connector,), {  # type: ignore[return-value]
        "__new__": __new__, "name": CONNECTOR_NAME, "fd_hookspec_version": FD_HOOKSPEC_VERSION,
        "settings_model": None, "__module__": __name__})


def _run_all(engines: list[EngineCore], requests: list[Request], target: EngineCore) -> dict[str, list[RequestOutput]]:
    """Step every engine in turn until each request added to ``target`` finished; outputs by id."""
    for request in requests:
        target.add_request(request)
    done: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    deadline = time.monotonic() + PATIENCE_S
    while any(not outputs or not outputs[-1].finished for outputs in done.values()):
        if time.monotonic() > deadline:
            late = sorted(i for i, outputs in done.items() if not outputs or not outputs[-1].finished)
            raise broken(SEAM, HANDOFF, f"request {late[0]!r} had not finished {PATIENCE_S:g} s after it was added "
                                        f"({len(done[late[0]])} outputs so far)")
        for engine in engines:
            engine.step()
        for output in target.get_results(timeout=0):
            done.setdefault(output.request_id, []).append(output)
        time.sleep(0.001)
    return done


def _all_free(engines: list[EngineCore]) -> bool:
    return all(e.resource_manager.num_free_blocks() == e.limits.num_blocks for e in engines)


def _drain(engines: list[EngineCore], invariant: str, what: str) -> None:
    """Step until every pool is free again (confirmations and aborts arrive asynchronously)."""
    def step() -> None:
        for engine in engines:
            engine.step()

    if not wait_until(lambda: _all_free(engines), FREE_WITHIN_S, poll=step, interval=0.01):
        held = ", ".join(f"{role} {e.limits.num_blocks - e.resource_manager.num_free_blocks()}"
                         for role, e in zip(("prefill", "decode"), engines, strict=True))
        raise broken(SEAM, invariant, f"{FREE_WITHIN_S:g} s after {what}, blocks still held: {held} "
                                      f"(of {_NUM_BLOCKS} each)")


def _handoff(rig: HandoffRig) -> None:
    mixed, prefill, decode = rig.engines()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    want = _run_all([mixed], [Request(f"h{i}", list(p), params) for i, p in enumerate(PROMPTS)], mixed)
    before = decode.stats().splitwise.get("transfers_done", 0)
    got = _run_all([prefill, decode], [Request(f"h{i}", list(p), params) for i, p in enumerate(PROMPTS)], decode)
    for request_id, expected in want.items():
        outputs = got[request_id]
        final = outputs[-1]
        if final.error or final.finish_reason != expected[-1].finish_reason:
            raise broken(SEAM, HANDOFF, f"request {request_id!r} ended with finish reason "
                                        f"{final.finish_reason.value if final.finish_reason else None!r} "
                                        f"({final.error or 'no error'}), the mixed engine's with "
                                        f"{expected[-1].finish_reason.value if expected[-1].finish_reason else None!r}")
        tokens = [t for o in outputs for t in o.new_token_ids]
        want_tokens = [t for o in expected for t in o.new_token_ids]
        if tokens != want_tokens:
            raise broken(SEAM, HANDOFF, f"request {request_id!r} decoded {tokens} after the hand-off, the mixed "
                                        f"engine {want_tokens} (greedy): the KV arrived damaged")
        if "".join(o.new_text for o in outputs) != "".join(o.new_text for o in expected):
            raise broken(SEAM, HANDOFF, f"request {request_id!r}'s text differs from the mixed engine's")
        if ([t.token_id for o in outputs for t in o.new_logprobs]
                != [t.token_id for o in expected for t in o.new_logprobs]):
            raise broken(SEAM, HANDOFF, f"request {request_id!r}'s logprobs differ from the mixed engine's")
    done = decode.stats().splitwise.get("transfers_done", 0) - before
    if done != len(PROMPTS):
        raise broken(SEAM, HANDOFF, f"{done} of {len(PROMPTS)} prompts came through a hand-off; the decode "
                                    "instance computed the others itself")
    _drain([prefill, decode], FREES, "the hand-offs completed")


def _handoff_abort(rig: HandoffRig) -> None:
    _, prefill, decode = rig.engines()
    _drain([prefill, decode], FREES, "the earlier hand-offs ended")
    received = prefill.stats().splitwise.get("jobs_received", 0)
    decode.add_request(Request("ha", list(PROMPTS[2]), SamplingParams(max_tokens=400, temperature=0.0,
                                                                       ignore_eos=True)))
    if not wait_until(lambda: prefill.stats().splitwise.get("jobs_received", 0) > received, FREE_WITHIN_S,
                      poll=decode.step):
        raise broken(SEAM, ABORT_FREES, f"the prefill instance did not receive the request within "
                                        f"{FREE_WITHIN_S:g} s")
    prefill.step()   # computes the prompt and ships it; its blocks stay held until the decode side answers
    decode.abort("ha")
    _drain([prefill, decode], ABORT_FREES, "the decode side aborted 'ha'")
    finals = [o for o in decode.get_results(timeout=0) if o.request_id == "ha" and o.finished]
    if not finals or finals[-1].finish_reason is None or finals[-1].finish_reason.value != "abort":
        raise broken(SEAM, ABORT_FREES, f"the aborted request ended with {finals[-1] if finals else 'no final output'}")


#: The hand-off checks, in the order they run (after the transport checks).
HANDOFF_CHECKS: Final = (
    Check("handoff", HANDOFF, _handoff),
    Check("handoff_abort", ABORT_FREES, _handoff_abort),
)
