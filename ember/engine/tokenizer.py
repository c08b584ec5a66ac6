"""Tokenizer and chat template from a checkpoint's files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``), through the ``tokenizers`` library and a sandboxed jinja2 template.

Every file problem is a ``ValueError`` naming the file: unreadable JSON in tokenizer_config.json, a
chat template that does not parse (with its line), or one that fails while rendering.

Example:
    >>> tok = load_tokenizer(Path("Qwen3-0.6B"))
    >>> tok.decode(tok.encode("hello"))
    'hello'
"""
from __future__ import annotations

import json
import traceback
from pathlib import Path


def read_json(file: Path) -> dict:
    """A JSON object from ``file``; a ValueError naming the file when it is not one."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _template_line(exc: BaseException) -> int | None:
    """The template line an exception raised while rendering came from (jinja2 marks its frames)."""
    line = getattr(exc, "lineno", None)
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == "<template>":
            line = frame.lineno
    return line


class Tokenizer:
    def __init__(self, tokenizer, config: dict, chat_template: str | None, template_source: str = "chat template"):
        self._tok = tokenizer
        self.config = config
        self.chat_template = chat_template
        self.template_source = template_source  # the file the template came from, for error messages
        self._compiled = None

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def _template(self):
        if self._compiled is None:
            from jinja2 import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(f"{self.template_source}: the chat template refused the messages: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(self.chat_template)
            except TemplateSyntaxError as e:
                raise ValueError(f"{self.template_source}: chat template does not parse (line {e.lineno}: "
                                 f"{e.message})") from None
        return self._compiled

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The conversation rendered by the checkpoint's template (``extra``: template variables
        such as ``enable_thinking``)."""
        if not self.chat_template:
            raise ValueError("tokenizer: this checkpoint has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); drop --chat or add one")
        template = self._template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self._special("bos_token") or "",
                                   eos_token=self._special("eos_token") or "", **extra)
        except ValueError as e:
            if str(e).startswith(self.template_source):  # raise_exception's own words
                raise
            err = e
        except Exception as e:  # jinja2's UndefinedError / SecurityError, or Python errors inside it
            err = e
        line = _template_line(err)
        where = f" at line {line}" if line else ""
        raise ValueError(f"{self.template_source}: chat template failed{where} ({type(err).__name__}: {err})") from None


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:
        raise ValueError(f"{file}: could not read the tokenizer ({type(e).__name__}: {e})") from None
    cfg_file = path / "tokenizer_config.json"
    config = read_json(cfg_file) if cfg_file.is_file() else {}
    template, source = config.get("chat_template"), f"{cfg_file} 'chat_template'"
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template, source = jinja.read_text(), str(jinja)
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{source}: expected the chat template as a string, got {type(template).__name__}")
    return Tokenizer(tok, config, template, source)
