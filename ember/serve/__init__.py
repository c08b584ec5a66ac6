"""``ember serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (the checkpoint's chat template),
``POST /v1/completions`` (text or token-id prompts), ``GET /health``, ``GET /metrics`` (Prometheus
text). Streaming is server-sent events, one chunk per token, ending ``data: [DONE]``. Errors are
OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}`` naming the field.

Safety: with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <key>`` (401);
bodies over ``max_body_bytes`` are refused (413); prompt + max_tokens beyond the model's
``max_seq_len`` is a 400 with both numbers; a full scheduler queue is a 429 with ``Retry-After``; a
client that disconnects has its request cancelled (its slot is free within one decode step).

Needs the ``serve`` extra (``pip install 'ember[serve]'``: FastAPI and uvicorn); ``import ember.serve``
works without it, :func:`app` says what is missing.

Example:
    >>> import ember, uvicorn
    >>> model = ember.load("Qwen/Qwen3-30B-A3B", max_batch_size=8)
    >>> uvicorn.run(ember.serve.app(model, api_key="secret"), host="127.0.0.1", port=8000)
"""
from __future__ import annotations

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt is ~0.5 MB of text; JSON escaping can double it


def app(model, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_name: str | None = None, scheduler=None):
    """The ASGI app (FastAPI) serving ``model`` through a :class:`~ember.engine.scheduler.Scheduler`.

    ``model``: an :class:`ember.Model` (its ``max_batch_size`` is the number of slots, its
    ``max_seq_len`` the most prompt + output tokens one request holds). ``model_name``: the id
    clients send as ``model`` (default ``model.name``). ``scheduler``: serve through this one
    (started, never shut down by the app) instead of a new one the app warms up on startup and
    shuts down on exit.

    Example:
        >>> from fastapi.testclient import TestClient
        >>> with TestClient(ember.serve.app(model)) as client:
        ...     client.post("/v1/completions", json={"model": model.name, "prompt": "Hello"}).json()
    """
    for name, v in (("max_queue", max_queue), ("max_body_bytes", max_body_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key or api_key != api_key.strip()):
        raise ValueError("api_key: expected a non-empty string without surrounding whitespace")
    try:
        from ember.serve._app import build
    except ModuleNotFoundError as e:
        if e.name not in ("fastapi", "starlette", "pydantic"):
            raise
        raise ModuleNotFoundError(f"ember.serve needs {e.name!r}: pip install 'ember[serve]'", name=e.name) from None
    return build(model, api_key=api_key, max_queue=max_queue, max_body_bytes=max_body_bytes, model_name=model_name,
                 scheduler=scheduler)
