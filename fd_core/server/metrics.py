"""The Prometheus metrics of ``GET /metrics``, in a registry of their own.

Three kinds of figures: the engine's own gauges and totals (running/waiting requests, KV blocks,
prefix-cache lookups, preemptions, token totals, busy / runner / CPU seconds, resident memory by
part at start-up), copied from an EngineStats snapshot taken when ``/metrics`` is scraped;
per-request latency histograms observed here from each request's final output (TTFT, TPOT,
end-to-end, queue time); and the front end's own process figures (``process_cpu_seconds_total``...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fd_core.outputs import RequestOutput

#: Content type of the exposition format.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS: Final = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                           20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0)


class _EngineCollector(Collector):
    """Exposes the latest EngineStats snapshot (a dict with ``kv`` nested), or only fd_engine_up 0."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot
        yield GaugeMetricFamily("fd_engine_up", "1 when the engine process is serving.", value=int(stats is not None))
        if stats is None:
            return
        kv = stats["kv"]
        yield GaugeMetricFamily("fd_num_requests_running", "Requests holding KV blocks now.", value=kv["num_running"])
        yield GaugeMetricFamily("fd_num_requests_waiting", "Requests queued in the scheduler or resource manager.",
                                value=kv["num_waiting"] + stats["num_waiting_in_scheduler"])
        yield GaugeMetricFamily("fd_kv_cache_blocks_total", "KV cache blocks in the pool.", value=kv["num_blocks"])
        yield GaugeMetricFamily("fd_kv_cache_blocks_free", "KV cache blocks free now.", value=kv["num_free_blocks"])
        yield GaugeMetricFamily("fd_kv_cache_blocks_used", "KV cache blocks in use now.",
                                value=kv["num_blocks"] - kv["num_free_blocks"])
        yield CounterMetricFamily("fd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=kv["prefix_cache_queries"])
        yield CounterMetricFamily("fd_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=kv["prefix_cache_hits"])
        yield CounterMetricFamily("fd_num_preemptions", "Requests preempted (blocks taken back).",
                                  value=kv["num_preemptions"])
        yield CounterMetricFamily("fd_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                                  value=stats["num_prompt_tokens"])
        yield CounterMetricFamily("fd_generation_tokens", "Tokens generated.", value=stats["num_generated_tokens"])
        yield CounterMetricFamily("fd_engine_steps", "Engine steps run.", value=stats["num_steps"])
        yield CounterMetricFamily("fd_spec_proposed_tokens", "Proposed tokens verified (speculative decoding).",
                                  value=stats["num_proposed_tokens"])
        yield CounterMetricFamily("fd_spec_accepted_tokens", "Proposed tokens accepted (speculative decoding).",
                                  value=stats["num_accepted_tokens"])
        yield from _time_metrics(stats)
        yield from _memory_metrics(stats.get("memory") or {})
        yield from _scheduler_metrics(stats.get("scheduler") or {})
        yield from _figure_metrics("fd_splitwise", "Prefill/decode hand-off", stats.get("splitwise") or {},
                                   gauges=_SPLITWISE_GAUGES)
        yield from _hook_metrics(stats.get("hooks") or [])
        if "ranks" in stats:
            yield from _rank_metrics(stats["ranks"])
            yield CounterMetricFamily("fd_dp_requests_continued", "Requests continued on another rank after "
                                      "theirs died.", value=stats["num_rescued"])


#: Scheduler figures that only grow (exported as counters; the others are gauges).
_SCHEDULER_COUNTERS: Final = frozenset({"served_for_peers", "taken_by_peers", "leases_expired", "reserved",
                                        "redis_round_trips", "degraded_episodes", "undecodable", "lapses",
                                        "deferred"})


#: Hand-off figures that go up and down (the others only grow).
_SPLITWISE_GAUGES: Final = frozenset({"transfers_open", "waiting_for_blocks", "jobs_open", "jobs_queued"})


def _time_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """Where the engine's time goes (summed over data-parallel ranks): with the front end's own
    ``process_cpu_seconds_total``, they tell the engine's work from the serving around it."""
    yield CounterMetricFamily("fd_engine_busy_seconds", "Wall time in engine steps that ran a batch.",
                              value=stats["busy_seconds"])
    yield CounterMetricFamily("fd_engine_runner_seconds", "Wall time in the model runner (forward pass, sampling).",
                              value=stats["runner_seconds"])
    yield CounterMetricFamily("fd_engine_cpu_seconds", "CPU time of the engine process (every thread).",
                              value=stats["cpu_seconds"])


#: The parts of ``EngineStats.memory`` that add up to the resident set (``fd_core.runner.memory``).
MEMORY_PARTS: Final = ("weights", "kv_cache", "runtime")


def _memory_metrics(memory: dict[str, int]) -> Iterator[Metric]:
    """``fd_memory_bytes{part}`` and the resident set it adds up to, with its peak, as measured when
    start-up ended (summed over data-parallel ranks); nothing before the engine measured them."""
    if not memory:
        return
    parts = GaugeMetricFamily("fd_memory_bytes", "Resident memory by part when start-up ended: weights as the "
                              "kernels hold them, the KV pool, and the rest (runtime).", labels=["part"])
    for part in MEMORY_PARTS:
        parts.add_metric([part], memory[part])
    yield parts
    yield GaugeMetricFamily("fd_memory_resident_bytes", "Resident memory (VmRSS) when start-up ended.",
                            value=memory["resident"])
    yield GaugeMetricFamily("fd_memory_peak_resident_bytes", "Peak resident memory (VmHWM) when start-up ended.",
                            value=memory["peak_resident"])


def _hook_metrics(traced: list[dict[str, Any]]) -> Iterator[Metric]:
    """``fd_hook_{calls,errors,seconds}_total{hook,plugin}`` (``plugins.trace_hooks``)."""
    if not traced:
        return
    families = {key: CounterMetricFamily(f"fd_hook_{key}", help_text, labels=["hook", "plugin"]) for key, help_text in (
        ("calls", "Calls of a hook implementation."),
        ("errors", "Calls of a hook implementation that raised."),
        ("seconds", "Time spent in a hook implementation."))}
    for figures in traced:
        for key, family in families.items():
            family.add_metric([figures["hook"], figures["plugin"]], figures[key])
    yield from families.values()


def _rank_metrics(ranks: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per data-parallel rank (label ``rank``): up, running, waiting, KV blocks, tokens in flight."""
    families = {name: GaugeMetricFamily(f"fd_dp_rank_{name}", help_text, labels=["rank"]) for name, help_text in (
        ("up", "1 while the data-parallel rank's engine serves."),
        ("requests_running", "Requests holding KV blocks on the rank."),
        ("requests_waiting", "Requests waiting on the rank's resource manager."),
        ("kv_cache_blocks_total", "KV cache blocks in the rank's pool."),
        ("kv_cache_blocks_free", "KV cache blocks free on the rank."),
        ("tokens_in_flight", "Prompt + max_tokens of the requests placed on the rank and not finished."))}
    generated = CounterMetricFamily("fd_dp_rank_generation_tokens", "Tokens generated by the rank.", labels=["rank"])
    for rank in ranks:
        label = [str(rank["rank"])]
        families["up"].add_metric(label, rank["up"])
        families["tokens_in_flight"].add_metric(label, rank["tokens_in_flight"])
        kv = rank.get("kv")
        if kv is not None:
            families["requests_running"].add_metric(label, kv["num_running"])
            families["requests_waiting"].add_metric(label, kv["num_waiting"])
            families["kv_cache_blocks_total"].add_metric(label, kv["num_blocks"])
            families["kv_cache_blocks_free"].add_metric(label, kv["num_free_blocks"])
            generated.add_metric(label, rank["generation_tokens"])
    yield from families.values()
    yield generated


def _scheduler_metrics(figures: dict[str, Any]) -> Iterator[Metric]:
    """``fd_scheduler_<figure>`` for each number of Scheduler.stats(); ``fd_scheduler_degraded`` 0/1."""
    yield GaugeMetricFamily("fd_scheduler_degraded", "1 while the scheduler serves degraded (see /health).",
                            value=int(bool(figures.get("degraded_reason"))))
    gauges = {key for key in figures if key not in _SCHEDULER_COUNTERS}
    yield from _figure_metrics("fd_scheduler", "Scheduler", figures, gauges=gauges)


def _figure_metrics(prefix: str, what: str, figures: dict[str, Any], *, gauges: set[str] | frozenset[str]
                    ) -> Iterator[Metric]:
    """``<prefix>_<figure>`` for each number in ``figures``: a gauge if named in ``gauges``, else a counter."""
    for key, value in sorted(figures.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = f"{prefix}_{key}"
        if key in gauges:
            yield GaugeMetricFamily(name, f"{what} figure {key} (now).", value=value)
        else:
            yield CounterMetricFamily(name, f"{what} figure {key} (total).", value=value)


class ServerMetrics:
    """The server's registry; :meth:`observe` each final output, :meth:`render` on scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        r = self.registry
        ProcessCollector(registry=r)   # the front end's own process_cpu_seconds_total, resident memory...
        self.ttft = Histogram("fd_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("fd_time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("fd_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("fd_request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("fd_request_finished", "Requests finished, by finish reason.", ["finish_reason"],
                                registry=r)
        self.request_prompt_tokens = Counter("fd_request_prompt_tokens", "Prompt tokens of finished requests.",
                                             registry=r)
        self.request_generation_tokens = Counter("fd_request_generation_tokens",
                                                 "Output tokens of finished requests.", registry=r)
        self.http_in_flight = Gauge("fd_http_requests_in_flight", "Generation HTTP requests being served.",
                                    registry=r)

    def observe(self, output: RequestOutput) -> None:
        """Record a request's final output."""
        reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
        self.finished.labels(finish_reason=reason).inc()
        self.request_prompt_tokens.inc(output.num_prompt_tokens)
        self.request_generation_tokens.inc(output.num_output_tokens)
        m = output.metrics
        if m is None:
            return
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                 (self.queue_time, m.queue_time)):
            if value is not None:
                histogram.observe(value)

    def render(self, engine_stats: dict[str, Any] | None) -> bytes:
        """The exposition text, with ``engine_stats`` (None when the engine is not up)."""
        self._engine.snapshot = engine_stats
        return generate_latest(self.registry)
