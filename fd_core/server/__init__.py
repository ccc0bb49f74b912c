"""The OpenAI-compatible HTTP server (``fd-serve``): a FastAPI front end linked to an engine process.

Modules: ``main`` (run uvicorn, signals), ``app`` (assembly, start-up, error handlers), ``routes``
(endpoints), ``body`` (the body-size limit), ``protocol`` (request bodies), ``prepare`` (bodies ->
engine requests), ``render`` (outputs -> OpenAI JSON), ``sse``, ``http_errors``, ``state``,
``drain`` (the shutdown deadline), ``metrics``, ``engine_client`` (the front end's side of the
engine link), ``engine_process`` (the other side), ``wire`` (messages).
See docs/server.md.
"""
