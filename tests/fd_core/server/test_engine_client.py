"""The front end's engine client against a real engine process: duplicate ids, a failing reader."""

from __future__ import annotations

import asyncio

import pytest

from fd_core.config import load_config
from fd_core.errors import EngineDeadError, PluginError, QueueFullError, RequestError
from fd_core.request import Request, SamplingParams
from fd_core.server import wire
from fd_core.server.engine_client import EngineClient, EngineState, _reject_error

PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


def _run(tiny_model, body, **client_args):
    config = load_config(model={"source": str(tiny_model)}, cache={"num_blocks": 64})

    async def main():
        client = EngineClient(config, log_level="WARNING", **client_args)
        try:
            await client.start(timeout=120)
            return await body(client)
        finally:
            await client.shutdown()

    return asyncio.run(main())


async def _collect(stream):
    return [output async for output in stream]


def test_a_live_duplicate_id_is_refused_without_touching_the_first(tiny_model):
    async def body(client):
        first = await client.add([Request("same", [5, 6, 7], PARAMS)])
        with pytest.raises(RequestError, match="already in use") as info:
            await client.add([Request("same", [8, 9], PARAMS)])
        assert info.value.field == "request_id"
        with pytest.raises(RequestError, match="'pair' is already in use"):
            await client.add([Request("pair", [5], PARAMS), Request("pair", [6], PARAMS)])
        return await _collect(first)

    outputs = _run(tiny_model, body)
    assert outputs[-1].finished and outputs[-1].num_output_tokens == PARAMS.max_tokens


def test_a_failure_while_routing_outputs_marks_the_engine_dead_instead_of_hanging(tiny_model):
    deaths = []

    def broken_observer(output):
        raise RuntimeError("metrics bug")

    async def body(client):
        stream = await client.add([Request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])
        with pytest.raises(EngineDeadError, match="stopped reading the engine's outputs .*metrics bug"):
            await asyncio.wait_for(_collect(stream), 60)
        return client.state

    state = _run(tiny_model, body, on_finished=broken_observer, on_dead=deaths.append)
    assert state is EngineState.DEAD
    assert len(deaths) == 1 and "metrics bug" in deaths[0]


def test_rejects_map_to_the_errors_the_http_layer_answers():
    assert isinstance(_reject_error(wire.QUEUE_FULL, None, "full"), QueueFullError)
    invalid = _reject_error(wire.INVALID, "request_id", "taken")
    assert isinstance(invalid, RequestError) and invalid.field == "request_id"
    internal = _reject_error(wire.INTERNAL, "flaky (pkg.mod:Flaky)", "put_request failed")
    assert isinstance(internal, PluginError) and str(internal) == "plugin flaky (pkg.mod:Flaky): put_request failed"
