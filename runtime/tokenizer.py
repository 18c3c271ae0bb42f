"""The artifact's tokenizer: `tokenizer.json` through the `tokenizers` library, and its chat template.

Chat templates are Jinja (as in transformers): `tokenizer_config.json`'s `chat_template` (a string, or a
list of named templates of which "default" is used) or a `chat_template.jinja` file. They render in a
sandboxed environment with the globals templates commonly call (`raise_exception`, `strftime_now`) and
the tokenizer's special-token strings (`bos_token`, `eos_token`, ...). The rendered text already holds
any BOS the template wants, so it is encoded without adding special tokens again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from runtime.errors import ArtifactError, InvalidRequestError

__all__ = ["TOKENIZER_FILE", "TextTokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

Message = Mapping[str, Any]


class TextTokenizer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        self.backend = tokenizer                  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template: Any = None

    @classmethod
    def from_dir(cls, directory: Path) -> TextTokenizer | None:
        """The tokenizer of an artifact directory, None when it has no tokenizer.json."""
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as exc:   # tokenizers raises a bare Exception for malformed files
            raise ArtifactError(f"{path}: cannot be read as a tokenizer ({str(exc).splitlines()[0]}); the "
                                "artifact is damaged, re-export it") from None
        config = _read_config(directory / CONFIG_FILE)
        template = _template_of(config, directory / TEMPLATE_FILE)
        specials = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}
        return cls(backend, template, specials)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text (InvalidRequestError when there is no template)."""
        if self.chat_template is None:
            raise InvalidRequestError("a chat (list of messages) needs a chat template; this artifact's tokenizer "
                                      "has none, pass the prompt text or token ids instead")
        if not all(isinstance(m, Mapping) and "role" in m for m in messages):
            raise InvalidRequestError("a chat must be a list of messages, each a dict with 'role' and 'content'")
        import jinja2

        try:
            return self._compiled().render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                           **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template cannot render these messages: {exc}") from None

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def _compiled(self) -> Any:
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        return self._template


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc}); the artifact is damaged, re-export it") from None
    return config if isinstance(config, dict) else {}


def _template_of(config: Mapping[str, Any], template_file: Path) -> str | None:
    if template_file.is_file():
        return template_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):   # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: Any) -> str:
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _environment() -> Any:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise InvalidRequestError("chat templates need jinja2; pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
