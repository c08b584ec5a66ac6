"""Tokenizer and chat template from a checkpoint's files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``), through the ``tokenizers`` library and a sandboxed jinja2 template.

Example:
    >>> tok = load_tokenizer(Path("Qwen3-0.6B"))
    >>> tok.decode(tok.encode("hello"))
    'hello'
"""
from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, tokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.config = config
        self.chat_template = chat_template

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("tokenizer: this checkpoint has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); drop --chat or add one")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ValueError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special("bos_token") or "", eos_token=self._special("eos_token") or "")


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
    config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    template = config.get("chat_template")
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(tok, config, template)
