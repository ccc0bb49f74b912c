"""The offline front doors: ``LLM(model=...)`` forms, and ``priority`` on LLM and AsyncLLM requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fd_core.engine.async_llm import AsyncLLM
from fd_core.engine.llm import LLM
from fd_core.errors import ConfigError, RequestError
from fd_core.request import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _record_priorities(engine) -> list[int]:
    """Make ``engine.add_request`` note the priority of every request it is given."""
    seen: list[int] = []
    add = engine.add_request

    def recording(request):
        seen.append(request.priority)
        add(request)

    engine.add_request = recording
    return seen


def test_model_takes_a_dict_of_model_section_keys(tiny_model_dir):
    llm = LLM(model={"source": tiny_model_dir, "max_model_len": 128, "served_name": "tiny"},
              cache={"num_blocks": 32})
    assert (llm.config.model.source, llm.config.model.max_model_len, llm.config.model.served_name) == (
        tiny_model_dir, 128, "tiny")
    assert llm.engine.max_model_len == 128 and llm.engine.model_name == "tiny"
    assert len(llm.generate([5, 6, 7], PARAMS)[0].token_ids) == 2


def test_model_takes_a_path_and_a_bad_key_names_its_path(tiny_model_dir):
    assert LLM(model=Path(tiny_model_dir), cache={"num_blocks": 32}).config.model.source == tiny_model_dir
    with pytest.raises(ConfigError, match="model.sorce") as info:
        LLM(model={"sorce": tiny_model_dir})
    assert info.value.key == "model.sorce"


def test_generate_sets_priority_per_prompt_or_for_all(make_llm):
    llm = make_llm()
    seen = _record_priorities(llm.engine)
    llm.generate([[5, 6], [7, 8], [9, 10]], PARAMS, priority=[2, -1, 0])
    llm.chat([{"role": "user", "content": "hi"}], PARAMS, priority=4)
    llm.generate([[5, 6], [7, 8]], PARAMS)
    assert seen == [2, -1, 0, 4, 0, 0]


@pytest.mark.parametrize(("priority", "match"), [
    (1001, "between -1000 and 1000"), (-5000, "between -1000 and 1000"), (True, "integer"), ("1", "integer"),
    ([0, 2.5], "integer")])
def test_a_bad_priority_is_refused_before_anything_is_queued(make_llm, priority, match):
    llm = make_llm()
    seen = _record_priorities(llm.engine)
    with pytest.raises(RequestError, match=match) as info:
        llm.generate([[5, 6], [7, 8]], PARAMS, priority=priority)
    assert info.value.field == "priority" and seen == []
    with pytest.raises(ValueError, match="got 3 priorities for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], PARAMS, priority=[0, 1, 2])


def test_async_generate_takes_a_priority(tiny_model_dir):
    async def main() -> list[int]:
        async with AsyncLLM.start(model={"source": tiny_model_dir, "max_model_len": 128},
                                  cache={"num_blocks": 32}) as llm:
            seen = _record_priorities(llm.engine)
            outputs = [o async for o in llm.generate([5, 6, 7], PARAMS, priority=-4)]
            assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 2
            with pytest.raises(RequestError, match="priority") as info:
                async for _ in llm.generate([5, 6], PARAMS, priority=5000):
                    pass
            assert info.value.field == "priority"
            return seen

    assert asyncio.run(main()) == [-4]
