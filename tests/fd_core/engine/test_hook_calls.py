"""Every hook call goes through one guard: a raising implementation loses no output, hides no
other implementation and is reported once; every way of running the engine starts and stops it.

The plugins here are real distributions (the ``install_plugin`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from fd_core.engine.async_llm import AsyncLLM
from fd_core.engine.llm import LLM
from fd_core.request import FinishReason, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _llm(model: str, hooks: list[str]) -> LLM:
    return LLM(model={"source": model}, cache={"num_blocks": 64}, plugins={"hooks": hooks})


def test_a_raising_step_hook_loses_no_final_output(install_plugin, tiny_model_dir, caplog):
    install_plugin("step_breaker", """
        @fd_core.hookimpl
        def fd_step_finished(plan, result, stats):
            raise RuntimeError("step hook bug")
    """)
    with _llm(tiny_model_dir, ["step_breaker"]) as llm, caplog.at_level(logging.ERROR):
        first = llm.generate([[5, 6, 7], [8, 9]], PARAMS)
        again = llm.generate([[5, 6, 7]], PARAMS)     # the ids were freed: the engine takes more
        assert llm.engine.resource_manager.num_free_blocks() == 64
    assert [r.finish_reason for r in first + again] == [FinishReason.LENGTH] * 3
    assert all(len(r.token_ids) == 6 for r in first + again)
    assert first[0].token_ids == again[0].token_ids
    reports = [r.getMessage() for r in caplog.records if "step hook bug" in r.getMessage()]
    assert len(reports) == 1, "reported once, not once per step"
    assert "step_breaker" in reports[0] and "fd_step_finished" in reports[0]


def test_a_raising_finish_hook_does_not_stop_the_others(install_plugin, tiny_model_dir, tmp_path):
    seen = tmp_path / "seen.jsonl"
    install_plugin("finish_recorder", f"""
        import json
        @fd_core.hookimpl
        def fd_request_finished(request, output):
            with open({str(seen)!r}, "a") as f:
                f.write(json.dumps([request.request_id, output.finish_reason.value]) + "\\n")
    """)
    install_plugin("finish_breaker", """
        @fd_core.hookimpl(tryfirst=True)
        def fd_request_finished(request, output):
            raise RuntimeError("finish hook bug")
    """)
    with _llm(tiny_model_dir, ["finish_recorder", "finish_breaker"]) as llm:
        results = llm.generate([[5, 6, 7], [8, 9], [10]], PARAMS)
    recorded = [json.loads(line) for line in seen.read_text().splitlines()]
    assert sorted(recorded) == sorted([r.request_id, "length"] for r in results)


def _lifecycle_plugin(install_plugin, name: str, log_file: Path) -> None:
    """A plugin writing "started" / "stopped" lines to ``log_file`` (a module name per test:
    Python keeps an imported module for the life of the process)."""
    install_plugin(name, f"""
        @fd_core.hookimpl
        def fd_engine_started(config):
            open({str(log_file)!r}, "a").write("started\\n")

        @fd_core.hookimpl
        def fd_engine_stopped():
            open({str(log_file)!r}, "a").write("stopped\\n")
    """)


def test_the_offline_llm_starts_and_stops_the_engine_once(install_plugin, tiny_model_dir, tmp_path):
    events = tmp_path / "events"
    _lifecycle_plugin(install_plugin, "lifecycle_offline", events)
    llm = _llm(tiny_model_dir, ["lifecycle_offline"])
    assert events.read_text().split() == ["started"]
    llm.generate([[5, 6, 7]], PARAMS)
    llm.generate([[5, 6, 7]], PARAMS)
    assert events.read_text().split() == ["started"]
    llm.close()
    llm.close()
    assert events.read_text().split() == ["started", "stopped"]


def test_an_offline_llm_that_is_dropped_still_stops_the_engine(install_plugin, tiny_model_dir, tmp_path):
    events = tmp_path / "events"
    _lifecycle_plugin(install_plugin, "lifecycle_dropped", events)
    llm = _llm(tiny_model_dir, ["lifecycle_dropped"])
    llm.generate([[5, 6, 7]], PARAMS)
    del llm
    import gc

    gc.collect()
    assert events.read_text().split() == ["started", "stopped"]


def test_async_llm_starts_and_stops_the_engine_once(install_plugin, tiny_model_dir, tmp_path):
    events = tmp_path / "events"
    _lifecycle_plugin(install_plugin, "lifecycle_async", events)

    async def main():
        async with AsyncLLM.start(model={"source": tiny_model_dir}, cache={"num_blocks": 64},
                                  plugins={"hooks": ["lifecycle_async"]}) as llm:
            async for out in llm.generate([5, 6, 7], PARAMS):
                last = out
            return last

    assert asyncio.run(main()).finish_reason is FinishReason.LENGTH
    assert events.read_text().split() == ["started", "stopped"]


def test_an_added_hook_refuses_on_purpose_and_later_ones_are_not_told(install_plugin, tiny_model_dir, tmp_path):
    told = tmp_path / "told"
    install_plugin("gatekeeper", """
        @fd_core.hookimpl(tryfirst=True)
        def fd_request_added(request):
            if len(request.prompt_token_ids) > 2:
                raise ValueError("prompts over 2 tokens are not allowed here")
    """)
    install_plugin("added_recorder", f"""
        @fd_core.hookimpl
        def fd_request_added(request):
            open({str(told)!r}, "a").write(str(len(request.prompt_token_ids)) + "\\n")
    """)
    with _llm(tiny_model_dir, ["gatekeeper", "added_recorder"]) as llm:
        refused, accepted = llm.generate([[5, 6, 7], [8, 9]], PARAMS)
        assert llm.engine.resource_manager.num_free_blocks() == 64
    assert refused.finish_reason is FinishReason.ERROR
    assert refused.error == ("the request was refused by plugin fd.plugins/gatekeeper: "
                             "prompts over 2 tokens are not allowed here")
    assert accepted.finish_reason is FinishReason.LENGTH and len(accepted.token_ids) == 6
    assert told.read_text().split() == ["2"]
