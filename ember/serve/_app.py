"""The FastAPI app: routes, auth, limits, SSE streaming, over :class:`ember.engine.scheduler.Scheduler`.

Thin on purpose: a route validates the body (:mod:`ember.serve.schemas`), renders and tokenizes the
prompt, checks it against the cache length, submits one scheduler Request and turns its Events into
OpenAI's JSON (one response, or one SSE chunk per token). Nothing here reads a file or loads a model.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.engine.scheduler import QueueFull, Request, Scheduler
from ember.serve.metrics import Metrics
from ember.serve.schemas import ChatCompletionRequest, CompletionRequest, RequestError, parse

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")
RETRY_AFTER_S = 1  # a full queue drains at decode speed: one second is many steps
_RESERVED_TEMPLATE_VARS = {"messages", "add_generation_prompt", "bos_token", "eos_token"}


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(error_body(e.message, type=e.type, param=e.param, code=e.code), status_code=e.status,
                        headers=e.headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Guard:
    """ASGI middleware: the API key (every route but /health) and the request counter by status."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"  # unknown paths share one label (bounded cardinality)
        status = [500]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and path != "/health":
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.key):  # constant time: the key is not guessable by timing
                    what = "wrong API key" if given else "no API key"
                    resp = JSONResponse(error_body(f"{what}: send the header 'Authorization: Bearer <key>' with "
                                                   "the key ember serve was started with (--api-key)",
                                                   code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                    return await resp(scope, receive, counted)
            await self.app(scope, receive, counted)
        finally:
            self.metrics.request(route, status[0])


class _Stream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends (finished, client gone, server stopping)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Server:
    """State shared by the routes: the model, its scheduler, the metrics, the limits."""

    def __init__(self, model, *, scheduler, model_name: str, max_body_bytes: int):
        self.model, self.scheduler, self.name = model, scheduler, model_name
        self.tok = model.tokenizer
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics()
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ request -> scheduler Request
    async def body(self, request: HTTPRequest) -> bytes:
        """The body, refused (413) past ``max_body_bytes`` whether Content-Length says so or not."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise RequestError(f"the body is {int(length)} bytes; this server takes at most {self.max_body_bytes} "
                               "(ember serve --max-body-bytes)", status=413, code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise RequestError(f"the body is over {self.max_body_bytes} bytes, the most this server takes "
                                   "(ember serve --max-body-bytes)", status=413, code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise RequestError(f"model: the model {name!r} does not exist; this server serves {self.name!r} "
                               "(GET /v1/models)", param="model", status=404, code="model_not_found")

    def _need_tokenizer(self, what: str, param: str) -> None:
        if self.tok is None:
            raise RequestError(f"{param}: {what} needs the checkpoint's tokenizer, and {self.name} has none "
                               "(tokenizer.json); send token ids to /v1/completions", param=param)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        self._need_tokenizer("a chat", "messages")
        if not self.tok.chat_template:
            raise RequestError(f"messages: {self.name} has no chat template (tokenizer_config.json 'chat_template' "
                               "or chat_template.jinja); use /v1/completions", param="messages")
        extra = body.chat_template_kwargs or {}
        clash = sorted(_RESERVED_TEMPLATE_VARS & set(extra))
        if clash:
            raise RequestError(f"chat_template_kwargs: {clash} are set by the server", param="chat_template_kwargs")
        messages = [{k: v for k, v in m.model_dump().items() if v is not None} | {"content": m.content or ""}
                    for m in body.messages]
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except ValueError as e:  # the template refused the conversation (raise_exception) or failed
            raise RequestError(f"messages: {e}", param="messages") from None
        return self.tok.encode(text)

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            self._need_tokenizer("a text prompt", "prompt")
            ids = self.tok.encode(body.prompt)
            if not ids:
                raise RequestError("prompt: the text encodes to no tokens", param="prompt")
            return ids
        return body.prompt

    def engine_request(self, body, prompt: list[int], max_tokens: int | None, logprobs: int | None,
                       prompt_param: str) -> Request:
        limit, P = self.model.max_seq_len, len(prompt)
        if max_tokens is None:  # as much as the cache row holds
            if P >= limit:
                raise RequestError(f"{prompt_param}: the prompt is {P} tokens; this server's max_seq_len is {limit}, "
                                   "which leaves no room for a new token", param=prompt_param,
                                   code="context_length_exceeded")
            max_tokens = limit - P
        elif P + max_tokens > limit:
            param = prompt_param if P >= limit else "max_tokens"
            raise RequestError(f"{param}: the prompt is {P} tokens and max_tokens is {max_tokens}: {P + max_tokens} "
                               f"> max_seq_len={limit} (the most one request can hold here)", param=param,
                               code="context_length_exceeded")
        if body.stop and self.tok is None:
            self._need_tokenizer("stop strings", "stop")
        try:
            return Request(prompt=prompt, max_tokens=max_tokens, sampling=body.sampling(),
                           stop_ids=frozenset(body.stop_token_ids or ()), stop_strings=body.stop or (),
                           logprobs=logprobs)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from None

    def submit(self, r: Request):
        try:
            return self.scheduler.submit(r)
        except QueueFull:
            raise RequestError("the server is busy: its request queue is full; retry after a moment", status=429,
                               type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (ValueError, TypeError) as e:  # the scheduler's own checks (token ids in the vocabulary, ...)
            raise RequestError(str(e)) from None

    # ------------------------------------------------------------------ Events -> OpenAI JSON
    def token_text(self, t: int) -> str:
        """A token's text in logprobs: its decoded text, or for a special token (which decodes to
        nothing) its vocabulary entry, so distinct tokens keep distinct keys in ``top_logprobs``."""
        s = self._token_text.get(t)
        if s is None:
            s = "" if self.tok is None else self.tok.decode([t])
            if not s:
                raw = getattr(getattr(self.tok, "_tok", None), "id_to_token", lambda _: None)(t)
                s = raw or f"token_id:{t}"
            self._token_text[t] = s
        return s

    def _entry(self, t: int, lp: float) -> dict:
        s = self.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    def chat_logprobs(self, events) -> dict:
        return {"content": [self._entry(e.token, e.logprob) | {"top_logprobs": [self._entry(t, lp) for t, lp in
                                                                               e.top_logprobs or ()]}
                            for e in events if e.token is not None], "refusal": None}

    def completion_logprobs(self, events, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in events:
            if e.token is None:
                continue
            out["tokens"].append(self.token_text(e.token))
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.token_text(t): lp for t, lp in e.top_logprobs or ()})
            out["text_offset"].append(offset)
            offset += len(e.text)
        return out

    def finished(self, handle, t0: float, stamps: list[float]) -> None:
        """Record a finished request; ``stamps``: when each token reached this server (perf_counter)."""
        ttft = handle.ttft_s if handle.ttft_s is not None else (stamps[0] - t0 if stamps else None)
        self.metrics.generation(finish_reason=handle.finish_reason or "cancelled", prompt_tokens=handle.prompt_tokens,
                                completion_tokens=handle.completion_tokens, ttft_s=ttft,
                                gaps=[b - a for a, b in zip(stamps, stamps[1:])], latency_s=time.perf_counter() - t0)

    @staticmethod
    def usage(handle) -> dict:
        return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": handle.completion_tokens,
                "total_tokens": handle.prompt_tokens + handle.completion_tokens}

    @staticmethod
    def failure(reason: str) -> RequestError:
        if reason == "cancelled":
            return RequestError("the server is shutting down; the request was cancelled", status=503,
                                type="server_error", code="shutting_down")
        return RequestError("the engine failed while generating this request (see the server's log)", status=500,
                            type="server_error", code="engine_error")

    async def completed(self, handle, request: HTTPRequest):
        """A non-streamed request's events once it ended with "stop" or "length"; None when the client
        went away first; the engine's failure or a shutdown raised as its RequestError."""
        events = await self.collect(handle, request)
        if events is not None and events[-1].finish_reason not in ("stop", "length"):
            raise self.failure(events[-1].finish_reason)
        return events

    async def collect(self, handle, request: HTTPRequest):
        """All of a handle's events, or None when the client went away first (the handle is cancelled)."""
        events, t0, stamps = [], time.perf_counter(), []

        async def consume():
            async for ev in handle:
                events.append(ev)
                if ev.token is not None:
                    stamps.append(time.perf_counter())

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():  # the client left (or the server is stopping): free the slot now
                handle.cancel()
                work.cancel()
            self.finished(handle, t0, stamps)
        if work.cancelled():
            return None
        work.result()  # an exception from the handle's iterator is the route's
        return events

    def stream(self, handle, make_chunk, first: list, include_usage: bool):
        """SSE: ``first`` chunks, one chunk per event (``make_chunk(event)``), the usage chunk, [DONE]."""
        t0, stamps = time.perf_counter(), []

        async def events():
            for c in first:
                yield _sse(c)
            async for ev in handle:
                if ev.token is not None:
                    stamps.append(time.perf_counter())
                if ev.finish_reason in ("cancelled", "error"):
                    e = self.failure(ev.finish_reason)
                    yield _sse(error_body(e.message, type=e.type, code=e.code))
                    break
                if ev.token is not None or ev.text or ev.finish_reason:
                    yield _sse(make_chunk(ev))
            else:
                if include_usage:
                    yield _sse(make_chunk(None) | {"choices": [], "usage": self.usage(handle)})
            yield "data: [DONE]\n\n"

        def closed():
            if handle.finish_reason is None:  # the client went away mid-stream
                handle.cancel()
            self.finished(handle, t0, stamps)

        return _Stream(events(), closed)


def build(model, *, api_key: str | None = None, max_queue: int = 256, max_body_bytes: int = 8 << 20,
          model_name: str | None = None, scheduler: Scheduler | None = None) -> FastAPI:
    """See :func:`ember.serve.app`."""
    own = scheduler is None
    sched = Scheduler(model, max_queue=max_queue) if own else scheduler
    srv = Server(model, scheduler=sched, model_name=model_name or model.name, max_body_bytes=max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if own:
            await run_in_threadpool(sched.warmup)  # CUDA graphs for every decode bucket, before the first request
        sched.start()
        try:
            yield
        finally:
            if own:
                sched.shutdown()

    app = FastAPI(title="ember", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(_Guard, api_key=api_key, metrics=srv.metrics)

    @app.exception_handler(RequestError)
    async def _request_error(_request, e: RequestError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        what = {404: "no such route (the routes are " + ", ".join(ROUTES) + ")",
                405: "method not allowed on this route"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(what, code=str(e.status_code)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(srv.metrics.render(sched.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ember", "max_model_len": model.max_seq_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = parse(ChatCompletionRequest, await srv.body(request))
        srv.check_model(body.model)
        prompt = await run_in_threadpool(srv.chat_prompt, body)  # a long template + encode off the event loop
        handle = srv.submit(srv.engine_request(body, prompt, body.token_limit, body.logprobs_k, "messages"))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": srv.name, "system_fingerprint": None}
        if body.stream:
            usage = {"usage": None} if body.include_usage else {}

            def chunk(ev):
                if ev is None:
                    return {**head, "object": "chat.completion.chunk"}
                delta = {"content": ev.text} if ev.token is not None or ev.text else {}
                lp = srv.chat_logprobs([ev]) if body.logprobs and ev.token is not None else None
                return {**head, "object": "chat.completion.chunk", **usage,
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}]}

            first = {**head, "object": "chat.completion.chunk", **usage,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            return srv.stream(handle, chunk, [first], body.include_usage)
        events = await srv.completed(handle, request)
        if events is None:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        reason = events[-1].finish_reason
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(e.text for e in events)},
                             "logprobs": srv.chat_logprobs(events) if body.logprobs else None,
                             "finish_reason": reason}],
                "usage": srv.usage(handle)}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = parse(CompletionRequest, await srv.body(request))
        srv.check_model(body.model)
        prompt = await run_in_threadpool(srv.completion_prompt, body)
        handle = srv.submit(srv.engine_request(body, prompt, body.max_tokens, body.logprobs, "prompt"))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": srv.name,
                "system_fingerprint": None}
        if body.stream:
            usage = {"usage": None} if body.include_usage else {}
            offset = [0]

            def chunk(ev):
                if ev is None:
                    return dict(head)
                lp = srv.completion_logprobs([ev], offset[0]) if body.logprobs is not None else None
                offset[0] += len(ev.text)
                return {**head, **usage, "choices": [{"index": 0, "text": ev.text, "logprobs": lp,
                                                      "finish_reason": ev.finish_reason}]}

            return srv.stream(handle, chunk, [], body.include_usage)
        events = await srv.completed(handle, request)
        if events is None:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        reason = events[-1].finish_reason
        return {**head, "choices": [{"index": 0, "text": "".join(e.text for e in events),
                                     "logprobs": srv.completion_logprobs(events, 0) if body.logprobs is not None else None,
                                     "finish_reason": reason}],
                "usage": srv.usage(handle)}

    return app
