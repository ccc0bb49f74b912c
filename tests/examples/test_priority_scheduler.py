"""examples/priority-scheduler, pip-installed: its README's deploy.toml passes ``fd-serve --check``;
on seeded traces with a small KV pool better priorities are admitted and finish first and only
worse ones are preempted; a real fd-serve takes ``priority`` from the openai client."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import openai
import pytest

from fd_core.engine.llm import LLM
from fd_core.request import FinishReason, Request, SamplingParams
from tests.conftest import run_fd_serve
from tests.fd_core.server.conftest import start_server

README = Path(__file__).resolve().parents[2] / "examples" / "priority-scheduler" / "README.md"
#: Finish times come from per-request metrics (arrival + e2e); requests ended in one step tie
#: up to float rounding, and steps are milliseconds apart.
SAME_STEP_S = 1e-4


def readme_deploy_toml() -> str:
    """The deploy.toml the example's README tells operators to write."""
    return next(block for block in re.findall(r"```toml\n(.*?)\n```", README.read_text(), re.S)
                if block.startswith("[plugins]"))


@pytest.fixture
def deploy_toml(tmp_path: Path, tiny_model: Path) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(f"{readme_deploy_toml()}\n\n[model]\nsource = {json.dumps(str(tiny_model))}\nmax_model_len = 256\n")
    return path


def _llm(tiny_model: Path, *, hooks: list[str], num_blocks: int, max_num_seqs: int) -> LLM:
    """An offline engine over the tiny model; ``hooks`` is ``plugins.hooks`` ([]: no hook plugin at all)."""
    return LLM(model={"source": str(tiny_model), "max_model_len": 256},
               cache={"num_blocks": num_blocks, "block_size": 16}, engine={"max_num_seqs": max_num_seqs},
               scheduler={"name": "local"}, resource_manager={"name": "v1"},
               plugins={"hooks": hooks})


def _inversions(priority: list[int], time: list[float]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` where ``i`` has the better priority but ``j`` got there first (by more than a step)."""
    return [(i, j) for i in range(len(priority)) for j in range(len(priority))
            if priority[i] < priority[j] and time[i] > time[j] + SAME_STEP_S]


# --- selected from deploy.toml ---------------------------------------------------------------


def test_the_readme_deploy_toml_selects_it_and_passes_check(priority_plugin, deploy_toml):
    check = run_fd_serve("--check", "--config", str(deploy_toml))
    assert check.returncode == 0, check.stderr
    resolved = json.loads(check.stdout)
    assert resolved["plugins"]["hooks"] == ["priority"]
    assert resolved["selected"]["scheduler"] == "local" and resolved["selected"]["resource_manager"] == "v1"

    listed = run_fd_serve("plugins", "list", "--config", str(deploy_toml))
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if line.split()[:2] == ["fd.plugins", "priority"])
    assert row[2:] == ["fd-priority-scheduler", "0.1.0", "loaded"], listed.stdout


# --- a seeded trace under load ---------------------------------------------------------------


def test_better_priorities_are_admitted_and_finish_first(priority_plugin, tiny_model):
    rng = random.Random(13)
    priorities = [rng.choice([0, 1, 2]) for _ in range(12)]
    prompts = [[rng.randrange(3, 512) for _ in range(16)] for _ in range(12)]   # distinct: no prefix-cache hits
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)     # 48 tokens: 3 blocks each

    def run(hooks: list[str]) -> tuple[list[float], list[float], int]:
        llm = _llm(tiny_model, hooks=hooks, num_blocks=8, max_num_seqs=4)   # 4 running need 12 blocks
        results = llm.generate(prompts, params, priority=priorities)
        assert all(r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 32 for r in results)
        assert llm.engine.resource_manager.num_free_blocks() == 8
        admitted = [r.metrics.arrival_time + r.metrics.queue_time for r in results]
        finished = [r.metrics.arrival_time + r.metrics.e2e for r in results]
        return admitted, finished, llm.engine.stats().kv.num_preemptions

    admitted, finished, preemptions = run(["priority"])
    assert preemptions > 0, "the trace must fill the KV pool"
    assert _inversions(priorities, admitted) == []
    assert _inversions(priorities, finished) == []

    # the same trace without the plugin runs in arrival order: the check above can tell
    _, fifo_finished, _ = run([])
    assert _inversions(priorities, fifo_finished) != []


def _drive(llm: LLM, waves: list[tuple[int, list[Request]]]) -> None:
    """Add each wave of requests before step number ``at``, then step until every request is done."""
    engine, step, pending = llm.engine, 0, sum(len(wave) for _, wave in waves)
    while pending:
        for at, wave in waves:
            if at == step:
                for request in wave:
                    engine.add_request(request)
        engine.step()
        step += 1
        pending -= sum(1 for output in engine.get_results(timeout=0) if output.finished)
        assert step < 2000, "the trace did not drain"


def test_preemption_takes_the_worst_priority_not_the_last_admitted(priority_plugin, tiny_model):
    rng = random.Random(7)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)     # 64 tokens: 4 blocks each

    def run(hooks: list[str]) -> tuple[list[Request], list[Request], int]:
        def request(name: str, priority: int) -> Request:
            return Request(name, [rng.randrange(3, 512) for _ in range(16)], params, priority=priority)

        # 4 low-priority requests fill the 16-block pool alone; 2 urgent ones arrive while they
        # run and are admitted last, so the built-in victim (the last admitted) would be them
        low = [request(f"low-{i}", 5) for i in range(4)]
        urgent = [request(f"urgent-{i}", 0) for i in range(2)]
        llm = _llm(tiny_model, hooks=hooks, num_blocks=16, max_num_seqs=6)
        _drive(llm, [(0, low), (8, urgent)])
        for r in low + urgent:
            assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 48, r
        assert llm.engine.resource_manager.num_free_blocks() == 16
        return low, urgent, llm.engine.stats().kv.num_preemptions

    low, urgent, total = run(["priority"])
    assert total > 0
    assert [r.num_preemptions for r in urgent] == [0, 0]
    assert sum(r.num_preemptions for r in low) == total

    _, default_urgent, _ = run([])   # without the plugin the urgent ones pay: the test can tell
    assert sum(r.num_preemptions for r in default_urgent) > 0


# --- through fd-serve and the openai client ----------------------------------------------------


def test_priority_from_the_openai_client_is_checked_and_accepted(priority_plugin, deploy_toml, tmp_path):
    server = start_server(tmp_path, "--config", str(deploy_toml), "--cache.num_blocks", "64",
                          "--plugins.trace_hooks", "true", name="priority")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "hi"}]
        for bad in (1001, -1001, "high", 1.5, True, None):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"priority": bad})
            assert info.value.body["param"] == "priority" and "priority" in info.value.body["message"], bad
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                               extra_body={"priority": bad})
            assert info.value.body["param"] == "priority", bad

        for good in (-1000, 0, 7, 1000):
            completion = client.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0,
                                                   extra_body={"priority": good})
            assert completion.usage.completion_tokens == 3
            chat = client.chat.completions.create(model=model, messages=messages, max_tokens=3,
                                                  extra_body={"priority": good})
            assert chat.choices[0].finish_reason == "length"
        stream = client.completions.create(model=model, prompt="hi", max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"priority": -3})
        assert [chunk.usage.completion_tokens for chunk in stream if chunk.usage] == [4]
        # hook tracing: the example's ordering hook was asked, and said so in /metrics
        text = httpx.get(server.url + "/metrics", timeout=10).text
        calls = re.search(r'^fd_hook_calls_total\{hook="fd_order_waiting",plugin="fd.plugins/priority"\} (\S+)$',
                          text, re.MULTILINE)
        assert calls and float(calls.group(1)) >= 8, text
    finally:
        assert server.stop() == 0, server.log()
