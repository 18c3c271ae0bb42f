"""The FastAPI app of `unispec serve`: OpenAI-compatible routes over one ServedModel.

    POST /v1/completions        prompt (text or token ids) -> text; `stream: true` for server-sent events
    POST /v1/chat/completions   messages -> the tokenizer's chat template -> the assistant's reply
    GET  /v1/models             the one served model
    GET  /health                200 while the server takes requests
    GET  /metrics               Prometheus text format (serve_metrics.py)

A streamed reply sends one chunk per engine step that made new text visible, then a chunk with the
finish_reason (and the token ids when `return_token_ids` is set), an optional usage chunk, and `[DONE]`.
With `n` > 1 the choices' chunks interleave, each with its `index`, and usage counts them all.
Every error is OpenAI-shaped JSON: 400 for a request the model cannot serve as given (a value of the wrong
type, bad sampling values, a prompt too long, a schema on an artifact without structured output), 404 for
an unknown model or route, 413 for a body over `max_request_bytes`; an unexpected failure is a one-line
500 (its traceback goes to the server's log), and the server keeps serving.

Hostile input is refused before it costs much: a body over the limit by its Content-Length before a byte
of it is read (and a chunked one as soon as it passes the limit), a prompt text longer than any prompt
that fits the context before it is tokenized (ServedModel.encode), then a prompt by its tokens.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from runtime.async_llm import AsyncStream
from runtime.errors import InvalidRequestError, UnispecError
from runtime.sequence import RequestOutput
from unispec.serve import ServeConfig, ServedModel, load_model
from unispec.serve_logprobs import token_chars
from unispec.serve_protocol import APIError, ChatRequest, CompletionRequest, Reply, error_body, sse

__all__ = ["build_app", "run_uvicorn"]

log = logging.getLogger("unispec.serve")


def build_app(model: ServedModel) -> FastAPI:
    from unispec import __version__

    app = FastAPI(title="unispec", version=__version__, docs_url=None, redoc_url=None)
    _error_handlers(app, model)
    app.add_middleware(_BodyLimit, model=model)
    started = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        import os

        return {"status": "ok", "model": model.name, "pid": os.getpid()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": started,
                                            "owned_by": "unispec", "max_model_len": model.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(model.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(model, body.model)
        params = body.sampling_params(default_max_tokens=16,          # OpenAI's default for completions
                                      defaults=model.llm.sampling_defaults)
        ids = await _encoded(model.encode(body.single_prompt()), "prompt")
        return await _answer(model, Reply.new("completion", model.name, body.return_token_ids, params.logprobs), ids,
                             params, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        _check_model(model, body.model)
        # a chat may run to the end of the context unless it says otherwise; the engine caps max_tokens there
        params = body.sampling_params(default_max_tokens=model.max_model_len, defaults=model.llm.sampling_defaults)
        ids = await _encoded(model.encode_chat(body.chat()), "messages")
        return await _answer(model, Reply.new("chat", model.name, body.return_token_ids, params.logprobs), ids,
                             params, body, request)

    return app


def _check_model(model: ServedModel, name: str) -> None:
    if name != model.name:
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{model.name}`",
                       param="model", code="model_not_found")


async def _encoded(encoding: Any, param: str) -> list[int]:
    try:
        return await encoding
    except InvalidRequestError as exc:
        raise APIError.from_invalid(exc, param) from None


async def _answer(model: ServedModel, reply: Reply, ids: list[int], params: Any, body: Any,
                  request: Request) -> Response:
    try:
        stream = await model.start(ids, params, endpoint=reply.kind)   # a request the engine refuses raises here
    except InvalidRequestError as exc:
        raise APIError.from_invalid(exc, body.structured_param if params.structured else None) from None
    if body.stream:
        return StreamingResponse(_stream(stream, reply, body.include_usage, params.n), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    outputs: dict[int, RequestOutput] = {}
    async with aclosing(stream):
        async for delta in stream:
            if delta.output is not None:
                outputs[delta.index] = delta.output
                if len(outputs) == params.n:
                    return JSONResponse(reply.full([outputs[i] for i in range(params.n)]))
            if await request.is_disconnected():
                break                         # closing the stream cancels the request
    return Response(status_code=499)          # nobody is listening any more


async def _stream(stream: AsyncStream, reply: Reply, include_usage: bool, n: int) -> AsyncIterator[str]:
    """Server-sent events; when the client disconnects, Starlette cancels this task, which closes `stream`."""
    async with aclosing(stream):
        try:
            if reply.kind == "chat":
                for index in range(n):
                    yield sse(reply.chunk("", role="assistant", index=index))
            outputs: dict[int, RequestOutput] = {}
            offsets = [0] * n                 # characters of the tokens whose logprobs each choice has sent
            async for delta in stream:
                # a chunk carries the logprobs of the tokens this delta brings (the last, its closing chunk's)
                logprobs = delta.logprobs if delta.output is None else None
                if delta.text or logprobs:
                    yield sse(reply.chunk(delta.text, index=delta.index, logprobs=logprobs,
                                          text_offset=offsets[delta.index]))
                    offsets[delta.index] += token_chars(logprobs or [])
                if delta.output is not None:
                    outputs[delta.index] = delta.output
                    yield sse(reply.chunk(output=delta.output, index=delta.index, logprobs=delta.logprobs,
                                          text_offset=offsets[delta.index]))
            if include_usage:
                yield sse(reply.usage_chunk([outputs[i] for i in range(n)]))
        except Exception as exc:              # the reply has started: report in the stream, as OpenAI does
            log.exception("a streamed request failed")
            yield sse(error_body(_one_line(exc), 500))
        yield sse("[DONE]")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _error_handlers(app: FastAPI, model: ServedModel) -> None:
    def reply(status: int, body: dict) -> JSONResponse:
        model.metrics.rejected.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(exc.status, exc.body())

    @app.exception_handler(UnispecError)
    async def unispec_error(request: Request, exc: UnispecError) -> JSONResponse:
        return reply(400, error_body(_one_line(exc), 400))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # the deepest error: of a union's branches, the one that got furthest (a bad chat content part's text,
        # not "content is not a string")
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
        if first.get("type") == "json_invalid":
            return reply(400, error_body("the request body is not valid JSON", 400, code="invalid_json"))
        where = [part for part in first.get("loc", ()) if part != "body" and not _UNION_BRANCH.match(str(part))]
        problem = first.get("msg", "invalid request body").removeprefix("Value error, ")
        message = f"{_field_path(where) or 'body'}: {problem}"
        return reply(400, error_body(message, 400, param=str(where[0]) if where else None, code="invalid_body"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 413:
            return reply(413, _too_large(model))
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return reply(exc.status_code, error_body(message, exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return reply(500, error_body(f"internal error: {_one_line(exc)}", 500))


def _too_large(model: ServedModel) -> dict:
    return error_body(f"the request body is over this server's limit of {model.max_request_bytes} bytes; send a "
                      "shorter prompt, or restart the server with a larger --max-request-bytes", 413,
                      code="request_too_large")


class _BodyLimit:
    """ASGI middleware: a 413 for a body over `model.max_request_bytes`, from its Content-Length before a
    byte of it is read, or as soon as a chunked body passes the limit (not after reading all of it)."""

    def __init__(self, app: Any, model: ServedModel) -> None:
        self.app, self.model = app, model

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.model.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            self.model.metrics.rejected.labels(status="413").inc()
            return await JSONResponse(_too_large(self.model), status_code=413)(scope, receive, send)
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413)      # FastAPI passes it on from its body reading to the handler
            return message

        await self.app(scope, limited, send)


# pydantic puts a union branch in an error's location (`str`, `list[ContentPart]`): not a request field
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list|dict)$|^[\w-]+\[.*\]$")


def _field_path(loc: list[Any]) -> str:
    """("messages", 0, "role") -> messages[0].role"""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def run_uvicorn(config: ServeConfig) -> None:
    """Serve the config's model in this process until interrupted."""
    import uvicorn

    app = build_app(load_model(config))
    # Open streams get a few seconds to finish on Ctrl-C; then they are cut (and their requests cancelled).
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5)
