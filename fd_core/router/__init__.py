"""``fd-serve router``: an OpenAI-compatible front with no model, forwarding each request to one backend fd-serve.

    config.py    the ``[router]`` section and its loader (TOML < env < CLI, errors by dotted key)
    backends.py  the pool: each backend's last /health, polled every ``router.health_interval_s``
    choose.py    the selection rule: which backend takes the next request
    forward.py   one request forwarded to the pool: retries before the first byte, streams relayed
    errors.py    the router's own API errors (503 no_backend, 502 backend_failed, 429, 413)
    metrics.py   the router's Prometheus registry
    routes.py    the HTTP endpoints
    app.py       the FastAPI application (pool and HTTP client started and stopped with it)
    main.py      bind, run uvicorn, exit codes

Nothing is imported here, so that ``import fd_core.router.config`` stays cheap (no FastAPI, no httpx).
See docs/router.md.
"""
