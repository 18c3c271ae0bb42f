"""The OpenAI wire format of `unispec serve`: request bodies, their SamplingParams, replies and errors.

Field names and defaults follow OpenAI's completions and chat completions APIs. vLLM's extensions are
accepted in the body too (the openai client's `extra_body`): `top_k`, `min_p`, `ignore_eos`,
`stop_token_ids`, and `return_token_ids` (the reply carries `prompt_token_ids` and each choice its
`token_ids`; a streamed reply sends them in its last chunk). OpenAI fields unispec cannot honour (n > 1,
logprobs, penalties, tools, ...) are refused with a 400 when set to anything but their neutral value:
ignoring them would hand the client an answer it did not ask for. Unknown fields are ignored, as vLLM does.

Types are strict, as the Python API's are: a bool is not an int (`"max_tokens": true` is a 400), a string
is not a bool (`"stream": "yes"`), a number field takes ints (`"temperature": 1`), an int field takes
whole floats (`16.0`: JSON Schema's integer), and text must be valid Unicode (a lone surrogate such as
`"\\ud800"` cannot be tokenized or sent back). A refused value is a 400 naming its field.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from runtime.errors import InvalidRequestError
from runtime.sampling_params import SamplingParams
from runtime.sequence import RequestOutput

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "Reply", "error_body"]

# every request model: no coercion between JSON types, no NaN or Infinity (see the module docstring)
STRICT = ConfigDict(strict=True, allow_inf_nan=False)

# OpenAI field -> its neutral values; anything else is refused (see the module docstring)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "tools": (None, []),
    "functions": (None, []), "audio": (None,), "modalities": (None, ["text"]),
}
# SamplingParams field (named in its errors) -> the request field a client set
_PARAM_OF_FIELD = {"json_schema": "response_format", "stop": "stop", "max_tokens": "max_tokens"}


def error_body(message: str, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class APIError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return error_body(str(self), self.status, param=self.param, code=self.code)

    @classmethod
    def from_invalid(cls, exc: InvalidRequestError, param: str | None = None) -> APIError:
        """A runtime InvalidRequestError as a 400; `SamplingParams.x` in its message names the field."""
        message = str(exc)
        named = re.search(r"SamplingParams\.(\w+)", message)
        if named and param is None:
            param = _PARAM_OF_FIELD.get(named[1], named[1])
        code = "context_length_exceeded" if "max_model_len" in message else None
        return cls(400, message.replace("SamplingParams.", ""), param=param, code=code)


def _valid_text(text: str) -> str:
    """Text the tokenizer can take and a reply can echo: no lone UTF-16 surrogate (JSON's `\\ud800`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate ({text[exc.start]!r} at character {exc.start}); send valid "
                         "Unicode text") from None
    return text


def _whole_number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Text = Annotated[str, AfterValidator(_valid_text)]
Int = Annotated[int, BeforeValidator(_whole_number)]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_shape(value: Any) -> Any:
    """OpenAI's four prompt shapes, one message for anything else (a union's would list every branch)."""
    if isinstance(value, str):
        return _valid_text(value)
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return [_valid_text(p) for p in value]
    if _is_token_ids(value) or (isinstance(value, list) and all(_is_token_ids(p) for p in value)):
        return value
    raise ValueError("must be a string, a list of token ids (ints), or a list holding one of those")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, **STRICT)
    name: Text = "response"
    schema_: dict[str, Any] = Field(alias="schema")


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def schema_text(self) -> str | None:
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format of type json_schema needs its json_schema.schema",
                               param="response_format")
            return json.dumps(self.json_schema.schema_)
        return None


class _Request(BaseModel):
    """What completions and chat completions share: model, sampling, streaming, structured output."""

    model_config = ConfigDict(extra="allow", **STRICT)
    model: Text
    # OpenAI marks these nullable: null means the default
    max_tokens: Int | None = None
    temperature: float | None = None    # 1.0
    top_p: float | None = None          # 1.0 (off)
    top_k: Int = 0                      # off; vLLM's -1 too
    min_p: float = 0.0                  # off
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: Int | None = None                # 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    return_token_ids: bool = False

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request's SamplingParams; an APIError (400) naming the field when a value is refused."""
        self._refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=self._max_tokens(default_max_tokens),
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k == -1 else self.top_k,
                min_p=self.min_p, seed=self.seed,
                stop=(*stop, *(self.stop_token_ids or ())), ignore_eos=self.ignore_eos,
                json_schema=self.response_format.schema_text() if self.response_format else None)
        except InvalidRequestError as exc:
            raise APIError.from_invalid(exc) from None

    def _max_tokens(self, default: int) -> int:
        return default if self.max_tokens is None else self.max_tokens

    def _refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported; unispec serve returns one choice (n=1)", param="n")
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(value == neutral for neutral in UNSUPPORTED[name]):
                raise APIError(400, f"{name} is not supported by unispec serve; leave it out", param=name)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_prompt_shape)]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a list of several prompts is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    type: Text
    text: Text = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    role: Text
    content: Text | list[ContentPart] | None = None

    def as_dict(self, index: int) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, f"messages[{index}] has a non-text content part; this model reads text only",
                               param="messages")
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None

    def _max_tokens(self, default: int) -> int:
        chosen = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return default if chosen is None else chosen

    def chat(self) -> list[dict[str, str]]:
        return [m.as_dict(i) for i, m in enumerate(self.messages)]


@dataclass(frozen=True)
class Reply:
    """Builds one request's reply bodies: the whole answer, or its stream chunks."""

    kind: Literal["completion", "chat"]
    model: str
    with_token_ids: bool = False
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: Literal["completion", "chat"], model: str, with_token_ids: bool) -> Reply:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, with_token_ids, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _envelope(self, choices: list[dict], streamed: bool) -> dict:
        obj = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        return {"id": self.id, "object": obj + (".chunk" if streamed and self.kind == "chat" else ""),
                "created": self.created, "model": self.model, "choices": choices}

    def full(self, output: RequestOutput) -> dict:
        """The non-streamed answer."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": output.finish_reason, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        body = self._envelope([self._with_ids(choice, output)], streamed=False)
        body["usage"] = usage(output)
        if self.with_token_ids:
            body["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    def chunk(self, text: str | None = None, *, role: str | None = None, output: RequestOutput | None = None) -> dict:
        """One streamed chunk: a text delta, the opening role (chat), or the closing finish_reason."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": output.finish_reason if output else None,
                                  "logprobs": None}
        if self.kind == "chat":
            choice["delta"] = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
        else:
            choice["text"] = text or ""
        body = self._envelope([self._with_ids(choice, output)], streamed=True)
        if output is not None and self.with_token_ids:
            body["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    def usage_chunk(self, output: RequestOutput) -> dict:
        """The extra last chunk `stream_options.include_usage` asks for: no choices, only usage."""
        return {**self._envelope([], streamed=True), "usage": usage(output)}

    def _with_ids(self, choice: dict, output: RequestOutput | None) -> dict:
        if output is not None and self.with_token_ids:
            choice["token_ids"] = list(output.token_ids)
        return choice


def usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(event: Mapping[str, Any] | str) -> str:
    """One server-sent event; `[DONE]` ends a stream, as OpenAI's does."""
    return f"data: {event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)}\n\n"
