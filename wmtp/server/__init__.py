"""OpenAI-compatible HTTP server over the engine (``wmtp serve``).

- ``protocol``: request models (unknown fields rejected) and the OpenAI error shape.
- ``runner``: the one background thread that owns the Engine; handlers talk to it through queues.
- ``detok``: incremental detokenisation and stop strings for streaming.
- ``chat``: the checkpoint's chat template (jinja2, sandboxed).
- ``metrics``: Prometheus collectors (one registry per app).
- ``app``: the FastAPI app factory.

Needs the ``serve`` extra (fastapi, uvicorn, jinja2, prometheus-client); ``import wmtp`` never loads it.
"""
