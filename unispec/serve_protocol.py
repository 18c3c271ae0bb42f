"""The OpenAI wire format of `unispec serve`: request bodies, their SamplingParams, replies and errors.

Field names and defaults follow OpenAI's completions and chat completions APIs, `n` choices included.
vLLM's extensions are accepted in the body too (the openai client's `extra_body`): `top_k`, `min_p`,
`ignore_eos`, `stop_token_ids`, `return_token_ids` (the reply carries `prompt_token_ids` and each choice its
`token_ids`; a streamed reply sends them in each choice's last chunk), and structured output as vLLM
spells it, `guided_json` / `guided_regex` / `guided_grammar` or `structured_outputs: {json | regex |
grammar | json_object}` (the same constraint as `response_format`; a 400 on an artifact without it).
A sampling field the request leaves out (temperature, top_p, top_k, min_p) takes the artifact's
generation_config.json default, as in vLLM, else the OpenAI default.

Log-probabilities (completions' `logprobs: k`, chat's `logprobs: true` + `top_logprobs: n`, at most the
artifact's max_logprobs) come back in OpenAI's shapes, streamed chunks included (serve_logprobs.py).

Every other field is refused with a 400 naming it, except IGNORED (harmless bookkeeping OpenAI clients
send: `user`, `metadata`, ...) and the NEUTRAL ones when set to their neutral value (`best_of: 1`,
`presence_penalty: 0`, ...): ignoring a field would hand the client an answer it did not ask for.

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
from runtime.sequence import RequestOutput, TokenLogprobs
from unispec.serve_logprobs import choice_logprobs

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "Reply", "error_body"]

# every request model: no coercion between JSON types, no NaN or Infinity (see the module docstring)
STRICT = ConfigDict(strict=True, allow_inf_nan=False)

# fields accepted with any value and ignored: bookkeeping that does not change the answer
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key")
# field -> its neutral values; any other value is refused (see the module docstring)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "audio": (None,), "modalities": (None, ["text"]),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
}
# SamplingParams field (named in its errors) -> the request field a client set
_PARAM_OF_FIELD = {"json_schema": "response_format", "stop": "stop", "max_tokens": "max_tokens",
                   "stop_token_ids": "stop_token_ids"}
# request field -> the SamplingParams field it sets (vLLM's structured output fields)
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}


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


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` body field (the constraints unispec can apply)."""

    model_config = ConfigDict(extra="forbid", **STRICT)
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    def constraint(self) -> dict[str, Any]:
        chosen = {"json_schema": self.json_, "regex": self.regex, "grammar": self.grammar,
                  "json_object": {"type": "object"} if self.json_object else None}
        chosen = {k: v for k, v in chosen.items() if v is not None}
        if len(chosen) > 1:
            raise APIError(400, f"structured_outputs sets {' and '.join(chosen)}; give one", param="structured_outputs")
        return {("json_schema" if k == "json_object" else k): v for k, v in chosen.items()}


class _Request(BaseModel):
    """What completions and chat completions share: model, sampling, streaming, structured output."""

    model_config = ConfigDict(extra="allow", **STRICT)
    model: Text
    # OpenAI marks these nullable: null means the default
    max_tokens: Int | None = None
    # null or absent: generation_config.json's default, else OpenAI's (in brackets)
    temperature: float | None = None    # 1.0
    top_p: float | None = None          # 1.0 (off)
    top_k: Int | None = None            # 0 (off); vLLM's -1 too
    min_p: float | None = None          # 0.0 (off)
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: Int | None = None                # 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool = False

    def sampling_params(self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The request's SamplingParams; an APIError (400) naming the field when a value is refused.
        `defaults`: the artifact's sampling defaults (LLM.sampling_defaults), for the fields left out."""
        self._refuse_unsupported()
        defaults = defaults or {}

        def chosen(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = chosen("top_k", 0)
        try:
            return SamplingParams(
                max_tokens=self._max_tokens(default_max_tokens), temperature=chosen("temperature", 1.0),
                top_p=chosen("top_p", 1.0), top_k=0 if top_k == -1 else top_k, min_p=chosen("min_p", 0.0),
                seed=self.seed, n=1 if self.n is None else self.n, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=self.logprob_count(), **self._constraint())
        except InvalidRequestError as exc:
            raise APIError.from_invalid(exc, self.structured_param if "SamplingParams sets" in str(exc) else None) \
                from None

    def _constraint(self) -> dict[str, Any]:
        """The SamplingParams structured-output field the request sets (at most one of them, else a 400)."""
        given = {name: getattr(self, name) for name in _GUIDED if getattr(self, name) is not None}
        if self.response_format is not None and self.response_format.schema_text() is not None:
            given["response_format"] = self.response_format.schema_text()
        if self.structured_outputs is not None and self.structured_outputs.constraint():
            given["structured_outputs"] = self.structured_outputs.constraint()
        if len(given) > 1:
            raise APIError(400, f"the request sets {' and '.join(given)}; give one structured output constraint",
                           param=self.structured_param)
        if not given:
            return {}
        name, value = next(iter(given.items()))
        return value if name == "structured_outputs" else {_GUIDED.get(name, "json_schema"): value}

    @property
    def structured_param(self) -> str | None:
        """The request field that asks for structured output (named by errors about it)."""
        for name in (*_GUIDED, "structured_outputs"):
            if getattr(self, name) is not None:
                return name
        return "response_format" if self.response_format is not None else None

    def _max_tokens(self, default: int) -> int:
        return default if self.max_tokens is None else self.max_tokens

    def _refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        unknown = [name for name in extra if name not in IGNORED and name not in NEUTRAL]
        if unknown:
            names = ", ".join(f"`{name}`" for name in unknown)
            many = len(unknown) > 1
            raise APIError(400, f"unknown or unsupported field{'s' * many} {names}: unispec serve does not take "
                           f"{'them' if many else 'it'}; leave {'them' if many else 'it'} out", param=unknown[0],
                           code="unsupported_field")
        for name, value in extra.items():
            # (True == 1 in Python: a bool is neutral only where the list holds that bool)
            if name in NEUTRAL and not any(value == neutral and isinstance(value, bool) == isinstance(neutral, bool)
                                           for neutral in NEUTRAL[name]):
                shown = json.dumps(value)
                raise APIError(400, f"{name}={shown if len(shown) <= 40 else shown[:37] + '...'} is not supported: "
                               "unispec serve does not support it; leave it out", param=name, code="unsupported_field")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_prompt_shape)]
    logprobs: Int | None = None         # top log-probabilities per token (the sampled token's too)

    def logprob_count(self) -> int | None:        # SamplingParams.logprobs (each request kind has its fields)
        return self.logprobs

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
    logprobs: bool | None = None        # each token's log-probability ...
    top_logprobs: Int | None = None     # ... and the n most likely tokens beside it

    def logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f"top_logprobs={self.top_logprobs} needs logprobs: true; set it", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

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
    logprobs: int | None = None         # top entries per token asked for (None: no logprobs)

    @classmethod
    def new(cls, kind: Literal["completion", "chat"], model: str, with_token_ids: bool,
            logprobs: int | None = None) -> Reply:
        return cls(kind, model, with_token_ids, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                   int(time.time()), logprobs)

    def _envelope(self, choices: list[dict], streamed: bool) -> dict:
        obj = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        return {"id": self.id, "object": obj + (".chunk" if streamed and self.kind == "chat" else ""),
                "created": self.created, "model": self.model, "choices": choices}

    def full(self, outputs: list[RequestOutput]) -> dict:
        """The non-streamed answer: one choice per completion (`n`), in order."""
        choices = []
        for index, output in enumerate(outputs):
            choice: dict[str, Any] = {"index": index, "finish_reason": output.finish_reason,
                                      "logprobs": choice_logprobs(self.kind, self.logprobs, output.logprobs)}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": output.text}
            else:
                choice["text"] = output.text
            choices.append(self._with_ids(choice, output))
        body = self._envelope(choices, streamed=False)
        body["usage"] = usage(outputs)
        if self.with_token_ids:
            body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
        return body

    def chunk(self, text: str | None = None, *, role: str | None = None, output: RequestOutput | None = None,
              index: int = 0, logprobs: list[TokenLogprobs] | None = None, text_offset: int = 0) -> dict:
        """One streamed chunk of choice `index`: a text delta (with its tokens' `logprobs`, their text from
        `text_offset`), the opening role (chat), or the closing finish_reason."""
        choice: dict[str, Any] = {"index": index, "finish_reason": output.finish_reason if output else None,
                                  "logprobs": choice_logprobs(self.kind, self.logprobs, logprobs or None, text_offset)}
        if self.kind == "chat":
            choice["delta"] = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
        else:
            choice["text"] = text or ""
        body = self._envelope([self._with_ids(choice, output)], streamed=True)
        if output is not None and self.with_token_ids:
            body["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        """The extra last chunk `stream_options.include_usage` asks for: no choices, only usage."""
        return {**self._envelope([], streamed=True), "usage": usage(outputs)}

    def _with_ids(self, choice: dict, output: RequestOutput | None) -> dict:
        if output is not None and self.with_token_ids:
            choice["token_ids"] = list(output.token_ids)
        return choice


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """The prompt counted once, the completions' tokens summed (as OpenAI counts n > 1)."""
    prompt, completion = len(outputs[0].prompt_token_ids), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(event: Mapping[str, Any] | str) -> str:
    """One server-sent event; `[DONE]` ends a stream, as OpenAI's does."""
    return f"data: {event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)}\n\n"
