"""``plugins.trace_hooks``: /metrics counts each hook implementation's calls and time."""

from __future__ import annotations

import httpx

from tests.fd_core.server.conftest import TINY_ARGS, start_server
from tests.fd_core.server.test_requests import metric, metrics


def test_traced_hooks_show_in_metrics_by_hook_and_plugin(demo_plugins, tiny_model, tmp_path):
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS, "--plugins.trace_hooks", "true",
                          "--plugins.hooks", '["priority-order"]')
    try:
        for _ in range(3):
            response = httpx.post(server.url + "/v1/completions", timeout=60,
                                  json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
        text = metrics(server.url)
        labels = '{hook="fd_order_waiting",plugin="fd.plugins/priority-order"}'
        assert metric(text, "fd_hook_calls_total", labels) >= 3, text
        assert metric(text, "fd_hook_errors_total", labels) == 0
        assert metric(text, "fd_hook_seconds_total", labels) > 0
    finally:
        server.stop()
