"""``fd-bench serve`` against a live tiny-model server: seeded workload, every request measured, JSON saved."""

from __future__ import annotations

import json

from fd_core.bench.cli import main as fd_bench
from fd_core.bench.workload import make_workload
from tests.fd_core.server.test_requests import metric, metrics


def prefix_cache_tokens(url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens from the server's prefix-cache counters."""
    text = metrics(url)
    return metric(text, "fd_prefix_cache_queries_total"), metric(text, "fd_prefix_cache_hits_total")


def test_workload_is_seeded_and_within_the_length_range():
    kwargs = {"num_prompts": 50, "input_len": 40, "output_len": 10, "range_ratio": 0.5, "vocab_size": 512}
    first, again = make_workload(seed=3, **kwargs), make_workload(seed=3, **kwargs)
    assert first == again and first != make_workload(seed=4, **kwargs)
    assert all(20 <= len(w.prompt) <= 60 and 5 <= w.output_len <= 15 for w in first)
    assert all(100 <= t < 512 for w in first for t in w.prompt)


def test_fd_bench_serve_measures_every_request(tiny_server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    queried, hits = prefix_cache_tokens(tiny_server.url)
    code = fd_bench(["serve", "--url", tiny_server.url, "--api-key", "sk-test", "--num-prompts", "12",
                     "--input-len", "160", "--output-len", "8", "--range-ratio", "0.25", "--max-concurrency", "4",
                     "--seed", "1", "--json-out", str(out)])
    assert code == 0
    # Prompts span whole KV blocks, so the cache is asked; neither the test request nor a timed one hits it.
    queried_after, hits_after = prefix_cache_tokens(tiny_server.url)
    assert queried_after > queried
    assert hits_after == hits
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_input_tokens"] == sum(report["input_lens"])
    assert report["total_output_tokens"] == sum(report["output_lens"])
    assert all(6 <= n <= 10 for n in report["output_lens"])
    assert report["mean_tokens_per_chunk"] == 1.0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < report[f"median_{name}_ms"] <= report[f"p99_{name}_ms"]
    assert "Output token throughput (tok/s):" in capsys.readouterr().out


def test_fd_bench_lists_its_subcommands(capsys):
    assert fd_bench([]) == 2          # no subcommand: usage on stderr, like any other mistake
    assert "serve" in capsys.readouterr().err
    assert fd_bench(["nope"]) == 2
