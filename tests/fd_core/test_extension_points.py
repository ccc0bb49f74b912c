"""The documented extension points refuse the misuses a plugin author hit, naming what to do:
hooks beat a subclass's order, settings models keep their base's keys, limits name their knob;
the hooks allow-list and hook tracing."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic import BaseModel

import fd_core
from fd_core.compat import FdDeprecationWarning
from fd_core.config import load_config
from fd_core.errors import ConfigError, QueueFullError
from fd_core.hook_trace import HookTracer
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request
from fd_core.selection import resolve
from fd_plugins.platforms.cpu import CpuPlatform, CpuSettings
from fd_plugins.schedulers.local import LocalScheduler, LocalSchedulerSettings
from tests.fd_core.engine.test_builder import ARCH


class _Reverse:
    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

    @fd_core.hookimpl
    def fd_order_waiting(self, waiting, now):
        return list(reversed(waiting))


def test_overriding_admission_order_still_works_as_default_order_with_a_deprecation_warning():
    with pytest.warns(FdDeprecationWarning, match="overrides admission_order, which bypassed every fd_order_waiting "
                                                  "hook; it is used as default_order until fd-engine 0.4.0"):
        class Longest(LocalScheduler):   # written against hookspec version 1's docs
            def admission_order(self, waiting, now):
                return sorted(waiting, key=lambda r: -r.num_prompt_tokens)

    assert "admission_order" not in Longest.__dict__ and "default_order" in Longest.__dict__
    requests = [Request(f"r{n}", [1] * n) for n in (1, 3, 2)]
    plain = Longest(None, hooks=Registry.from_plugins({}).hooks, max_queue_size=8)
    hooked = Longest(None, hooks=Registry.from_plugins({}, general=[_Reverse()]).hooks, max_queue_size=8)
    for scheduler in (plain, hooked):
        for request in requests:
            scheduler.put_request(request)
    assert [r.request_id for r in plain.get_requests(3, timeout=0)] == ["r3", "r2", "r1"]    # its own order
    assert [r.request_id for r in hooked.get_requests(3, timeout=0)] == ["r2", "r3", "r1"]   # the hook first


def test_overriding_both_orders_is_refused_at_class_definition():
    with pytest.raises(TypeError, match="overrides both admission_order and default_order"):
        class Both(LocalScheduler):   # noqa: F841
            def admission_order(self, waiting, now):
                return waiting

            def default_order(self, waiting, now):
                return waiting


def test_hooks_take_precedence_over_a_subclass_default_order():
    class Shortest(LocalScheduler):
        def default_order(self, waiting, now):
            return sorted(waiting, key=lambda r: r.num_prompt_tokens)

    requests = [Request(f"r{n}", [1] * n) for n in (3, 1, 2)]
    plain = Shortest(None, hooks=Registry.from_plugins({}).hooks, max_queue_size=8)
    hooked = Shortest(None, hooks=Registry.from_plugins({}, general=[_Reverse()]).hooks, max_queue_size=8)
    for scheduler in (plain, hooked):
        for request in requests:
            scheduler.put_request(request)
    assert [r.request_id for r in plain.get_requests(3, timeout=0)] == ["r1", "r2", "r3"]
    assert [r.request_id for r in hooked.get_requests(3, timeout=0)] == ["r2", "r1", "r3"]   # arrival, reversed


def test_settings_models_must_keep_the_base_keys():
    class Own(BaseModel):
        greeting: str = "hi"

    with pytest.raises(TypeError, match="settings_model must subclass LocalSchedulerSettings"):
        type("BadScheduler", (LocalScheduler,), {"settings_model": Own})
    with pytest.raises(TypeError, match="settings_model must subclass CpuSettings"):
        type("BadPlatform", (CpuPlatform,), {"settings_model": Own})
    type("GoodScheduler", (LocalScheduler,), {"settings_model": type("S", (LocalSchedulerSettings,), {})})
    type("GoodPlatform", (CpuPlatform,), {"settings_model": type("C", (CpuSettings,), {})})


def test_the_queue_full_error_names_the_plugins_own_limit():
    class Capped(LocalScheduler):
        queue_limit_key: ClassVar[str] = "scheduler.options.max_waiting"

    scheduler = Capped(None, hooks=None, max_queue_size=1)
    scheduler.put_request(Request("a", [1]))
    with pytest.raises(QueueFullError,
                       match=r"the most scheduler.options.max_waiting \(1\) allows; retry, or raise it"):
        scheduler.put_request(Request("b", [1]))


def test_a_kv_cap_of_the_platform_is_named_as_such():
    class Capped(CpuPlatform):
        def kv_cache_memory_bytes(self, *, utilization, weights_bytes, activation_reserve_bytes):
            return 1 << 20

    config = load_config(cache={"memory_utilization": 0.5})
    with pytest.raises(ConfigError) as info:
        from fd_core.engine.builder import plan_kv_pool

        plan_kv_pool(config, ARCH, Capped(), max_model_len=4096, weights_bytes=0)
    assert info.value.key == "platform.options" and "the platform's own limit applies" in str(info.value)


def test_the_hooks_allow_list_registers_only_the_named_hook_plugins(demo_plugins):
    from tests.conftest import run_fd_serve  # a fresh interpreter sees the freshly installed plugins

    def row(table: str) -> str:
        return next(line for line in table.splitlines() if line.startswith("fd.plugins") and "priority-order" in line)

    assert row(run_fd_serve("plugins", "list").stdout).endswith("loaded")
    assert row(run_fd_serve("plugins", "list", "--plugins.hooks", "[]").stdout).endswith(
        "disabled: not in plugins.hooks")
    refused = run_fd_serve("--check", "--plugins.hooks", '["nope"]')
    assert refused.returncode == 2
    assert "fd-serve: error: plugins.hooks: no installed hook plugin (fd.plugins entry point) is named 'nope'" \
        in refused.stderr
    assert run_fd_serve("--check", "--plugins.hooks", '["fd.plugins/priority-order"]').returncode == 0


def test_hook_tracing_counts_calls_errors_and_time():
    class Flaky:
        fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

        def __init__(self):
            self.calls = 0

        @fd_core.hookimpl
        def fd_request_added(self, request):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom")

    registry = Registry.from_plugins({}, general=[Flaky()])
    tracer = HookTracer()
    tracer.install(registry.plugin_manager)
    tracer.install(registry.plugin_manager)   # twice: still counted once per call
    registry.hooks.fd_request_added(request=Request("a", [1]))
    with pytest.raises(RuntimeError):
        registry.hooks.fd_request_added(request=Request("b", [1]))
    (figures,) = [f for f in tracer.snapshot() if f["hook"] == "fd_request_added"]
    assert figures["plugin"] == "fd.plugins/Flaky" and figures["calls"] == 2 and figures["errors"] == 1
    assert figures["seconds"] > 0


def test_admitted_time_follows_readmission_after_a_preemption():
    from fd_core.contracts.resource_manager import KVLimits
    from fd_core.request import SamplingParams
    from fd_plugins.resource_managers.v1.manager import V1ResourceManager

    limits = KVLimits(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    manager = V1ResourceManager(None, limits=limits, hooks=Registry.from_plugins({}).hooks)
    first, second = (Request(name, [1] * 7, SamplingParams(max_tokens=8)) for name in ("first", "second"))
    manager.add_request(first)
    manager.add_request(second)
    manager.schedule()   # both admitted: 2 blocks each
    admitted = second.admitted_time
    for request in (first, second):
        request.output_token_ids.append(5)
    first.output_token_ids.extend([5] * 2)   # first needs a third block: the last admitted is preempted
    manager.schedule()
    assert second.num_preemptions == 1 and second.scheduled_time is not None
    while second.num_computed_tokens == 0:
        manager.finish_requests([first], FinishReason.LENGTH)
        manager.schedule()
    assert second.admitted_time > admitted and second.scheduled_time <= admitted


def test_check_asks_the_platform_what_start_up_will():
    from fd_plugins.resource_managers.v1.manager import V1ResourceManager
    from fd_plugins.token_processors.default import DefaultTokenProcessor

    class ThreadlessCpu(CpuPlatform):
        name: ClassVar[str] = "threadless"

        def num_threads(self) -> int:
            raise RuntimeError("no threads here")

    registry = Registry.from_plugins({"platform": [ThreadlessCpu], "scheduler": [LocalScheduler],
                                      "resource_manager": [V1ResourceManager],
                                      "token_processor": [DefaultTokenProcessor]})
    with pytest.raises(ConfigError, match=r"platform.name: plugin threadless \(.*ThreadlessCpu\): "
                                          r"num_threads\(\) raised RuntimeError: no threads here"):
        resolve(load_config(platform={"name": "threadless"}), registry)


def test_seam_classes_registered_through_a_hook_load_and_a_raising_registration_fails_its_plugin(install_plugin):
    install_plugin("contributes_scheduler", """
        from fd_plugins.schedulers.local import LocalScheduler

        class Contributed(LocalScheduler):
            name = "contributed"

        @fd_core.hookimpl
        def fd_register_schedulers():
            return [Contributed]
    """)
    install_plugin("registration_breaker", """
        @fd_core.hookimpl
        def fd_register_platforms():
            raise RuntimeError("cannot list my platforms")
    """)
    registry = Registry.discover(hooks=["contributes_scheduler", "registration_breaker"])
    (contributed,) = [r for r in registry.records("scheduler") if r.name == "contributed"]
    assert contributed.status == "loaded" and contributed.dist == "contributes_scheduler"
    (broken,) = [r for r in registry.records("general") if r.name == "registration_breaker"]
    assert broken.status == "failed"
    assert broken.reason == "fd_register_platforms raised RuntimeError: cannot list my platforms"
    with pytest.raises(fd_core.PluginLoadError, match="registration_breaker.*fd_register_platforms raised"):
        Registry.discover(strict=True, hooks=["registration_breaker"])
