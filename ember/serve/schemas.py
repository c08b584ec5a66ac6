"""Request bodies of the OpenAI-compatible routes, validated strictly (pydantic, strict mode).

Strict because a client sending ``"max_tokens": "16"`` or ``"stream": 1`` has a bug the server
should name, not guess around: every wrong type, out-of-range value or unknown field is a 400 whose
``param`` names the field (``messages[1].content``). Fields OpenAI defines that ember does not
implement (penalties, logit_bias, tools, ...) are accepted at their no-op value and refused with a
message otherwise, so a request never silently means something else here than on OpenAI.
ember's extra sampling fields ``top_k`` and ``min_p`` (and ``stop_token_ids``) are accepted as vLLM
accepts them (``extra_body`` in the openai client).

Example:
    >>> body = ChatCompletionRequest.model_validate_json(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    >>> body.sampling().temperature
    1.0
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

INT64 = 2 ** 63
MAX_TOP_LOGPROBS = 20  # the scheduler's limit (Request.logprobs <= 20), also OpenAI's
MAX_STOP = 16  # OpenAI allows 4; a few more cost nothing, hundreds would cost a scan per token


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        """A string, or a list of ``{"type": "text", "text": ...}`` parts (joined); images and audio
        are refused (text-only models)."""
        if v is None or isinstance(v, str):
            return v or ""
        if not isinstance(v, list):
            raise ValueError(f"expected a string or a list of text parts, got {_json_type(v)}")
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise ValueError(f"part {i}: expected {{'type': 'text', 'text': str}}, got type {kind!r} "
                                 "(this server takes text only)")
            texts.append(part["text"])
        return "".join(texts)


class _Sampling(_Strict):
    """Fields both routes share: sampling, stopping, streaming, and OpenAI fields held at their no-op."""
    model: str
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM's spelling of "off" is -1; ember's is 0
    min_p: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Any = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = Field(None, ge=1)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # accepted and ignored: they describe bookkeeping on OpenAI's side, not the generation
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"expected a string or a list of strings, got {_json_type(v)}")
        if len(items) > MAX_STOP:
            raise ValueError(f"expected at most {MAX_STOP} stop strings, got {len(items)}")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return tuple(items)

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v not in (None, 0):
            raise ValueError(f"not supported (only 0), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("not supported (only an empty map)")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "only allowed when stream is true")
        return self

    def sampling(self):
        """The request's :class:`ember.SamplingParams` (OpenAI's default temperature is 1)."""
        from ember.ops.sampling import SamplingParams
        top_k = self.top_k or 0
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_k=max(top_k, 0), top_p=1.0 if self.top_p is None else self.top_p,
                              min_p=self.min_p or 0.0, seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables (enable_thinking, ...)

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v):
        if v is not None and v != {"type": "text"}:
            raise ValueError(f"only {{'type': 'text'}} is supported, got {v!r}")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError(f"tool calling is not supported, got {v!r}")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "needs logprobs to be true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise _FieldError("max_completion_tokens", f"disagrees with max_tokens ({self.max_completion_tokens} "
                                                       f"vs {self.max_tokens}); send one of them")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        """Request.logprobs: None (off), 0 (the chosen token's only) or the top-k count."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        """A string or a list of token ids; a batch of one ([str] / [[ids]]) is unwrapped."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("expected a non-empty string")
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
            raise ValueError(f"a batch of {len(v)} prompts is not supported; send one prompt per request")
        if v == []:
            raise ValueError("expected a non-empty prompt")
        raise ValueError(f"expected a string or a list of integer token ids, got {_json_type(v)}")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported (only false)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported (only null or empty)")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v


class _FieldError(ValueError):
    """A whole-body check that still names one field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestError(ValueError):
    """A request the server refuses: HTTP status, OpenAI error type, the field it names."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers or {}


def _json_type(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _param(loc) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def parse(model: type[_Strict], body: bytes) -> _Strict:
    """The validated request, or a :class:`RequestError` naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        kind, loc = err["type"], err["loc"]
        if kind == "json_invalid":
            raise RequestError(f"the body is not valid JSON ({err['ctx']['error']})") from None
        if kind == "model_type" and not loc:
            raise RequestError("the body must be a JSON object") from None
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _FieldError):
            raise RequestError(f"{cause.param}: {cause}", param=cause.param) from None
        param = _param(loc)
        if kind == "extra_forbidden":
            raise RequestError(f"{param}: unrecognized field", param=param) from None
        if kind == "missing":
            raise RequestError(f"{param}: field required", param=param) from None
        msg = str(cause) if isinstance(cause, ValueError) else err["msg"]
        given = err.get("input")
        shown = "" if isinstance(cause, ValueError) or isinstance(given, (dict, list)) else f", got {given!r}"
        raise RequestError(f"{param}: {msg}{shown}", param=param) from None
