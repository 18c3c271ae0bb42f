"""`unispec serve`: one artifact behind an OpenAI-compatible HTTP API (uvicorn), or on Ray Serve replicas.
This module holds what both share: the config and the served model; serve_app.py builds the app and
runs it under uvicorn, serve_ray.py deploys it on Ray Serve.

    client ─HTTP─▶ uvicorn ─▶ FastAPI app (serve_app.py) ─▶ ServedModel ─▶ AsyncLLM ─threads─▶ LLM (one engine, one lock)
    client ─HTTP─▶ Ray Serve proxy ─router─▶ replica 1..N, each the same app on its own LLM (serve_ray.py)

Concurrency: the LLM is blocking and guarded by one lock; a thread that waits for its request's next
tokens runs one step for every request in flight (runtime/llm.py). So each open request waits for its
deltas in a worker thread, never on the event loop (runtime/async_llm.py's AsyncLLM does the hand-off),
and all connections share one continuous batch. At most `max_batch_size` requests (n > 1 counts n) are in
the engine at once; later ones wait (FIFO) for a slot. A request whose client goes away is cancelled,
which frees its KV blocks at once.

Bounds on what one request may cost before it is refused: `max_request_bytes` on the HTTP body (default
4 MiB of text plus room for the longest token-id prompt the context allows), and a prompt text's length in
characters, which can be checked without tokenizing: no token spans more characters than the longest
entry of the vocabulary, so a text longer than max_model_len times that can never fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import UnispecError
from runtime.sequence import RequestOutput

if TYPE_CHECKING:
    from runtime.async_llm import AsyncStream

__all__ = ["ServeConfig", "ServedModel", "load_model", "require_serve_extra"]

MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    artifact_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "ort"
    served_model_name: str | None = None       # None: the artifact directory's name
    max_batch_size: int | None = None          # requests in the engine at once; None: the artifact's bound
    max_model_len: int | None = None           # None: the artifact's
    kv_memory_mib: int | None = None           # None: the LLM's default budget
    chat_template: Path | None = None          # a Jinja file replacing the artifact's chat template
    replicas: int = 1                          # > 1 (or ray / max_replicas) deploys on Ray Serve
    max_replicas: int | None = None            # Ray Serve autoscales between replicas and this
    ray: bool = False
    cpus_per_replica: float = 1.0
    gpus_per_replica: float | None = None      # None: 1 for the trt backend, else 0
    log_level: str = "info"
    max_request_bytes: int | None = None       # None: default_request_bytes(), from the model's context
    speculation: str = "auto"                  # LLM(speculation=): auto, always or never

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifact_dir", Path(self.artifact_dir))
        checks = [
            ("port", 0 <= self.port <= 65535, "an int in [0, 65535]"),
            ("max_batch_size", self.max_batch_size is None or self.max_batch_size >= 1, "an int >= 1"),
            ("kv_memory_mib", self.kv_memory_mib is None or self.kv_memory_mib >= 1, "an int >= 1"),
            ("max_request_bytes", self.max_request_bytes is None or self.max_request_bytes >= 1, "an int >= 1"),
            ("replicas", self.replicas >= 1, "an int >= 1"),
            ("max_replicas", self.max_replicas is None or self.max_replicas >= self.replicas, "an int >= --replicas"),
            ("cpus_per_replica", self.cpus_per_replica >= 0, "a number >= 0"),
            ("gpus_per_replica", self.gpus_per_replica is None or self.gpus_per_replica >= 0, "a number >= 0"),
        ]
        for name, ok, valid in checks:
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise UnispecError(f"{flag} {getattr(self, name)!r} is invalid; use {valid}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.artifact_dir.resolve().name

    @property
    def uses_ray(self) -> bool:
        return self.ray or self.replicas > 1 or self.max_replicas is not None

    @property
    def replica_gpus(self) -> float:
        if self.gpus_per_replica is not None:
            return self.gpus_per_replica
        return 1.0 if self.backend == "trt" else 0.0


class ServedModel:
    """One LLM behind the API: text and chats to token ids, requests to async streams of deltas."""

    def __init__(self, llm: Any, *, name: str, max_batch_size: int, chat_template: str | None = None,
                 max_request_bytes: int | None = None) -> None:
        from runtime.async_llm import AsyncLLM
        from unispec.serve_metrics import ServeMetrics

        self.llm, self.name, self.max_batch_size = llm, name, max_batch_size
        self.async_llm = AsyncLLM(llm, max_concurrency=max_batch_size)
        self.max_model_len = llm.engine.max_model_len
        self.max_request_bytes = max_request_bytes or default_request_bytes(self.max_model_len,
                                                                            llm.manifest.vocab_size)
        # a text of more characters than this is longer than any prompt that fits (module docstring)
        self.max_prompt_chars = None if llm.tokenizer is None else \
            self.max_model_len * _longest_token_chars(llm.tokenizer.backend)
        self.metrics = ServeMetrics(llm)
        self.chat_tokenizer = llm.tokenizer
        if chat_template is not None and llm.tokenizer is not None:
            from runtime.tokenizer import TextTokenizer

            t = llm.tokenizer
            self.chat_tokenizer = TextTokenizer(t.backend, chat_template, t.special_tokens)

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.async_llm.run(fn, *args)

    async def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            self._check_length(len(prompt), "prompt", "characters")
        else:          # ids are checked one by one after this: refuse a long list by its length first
            self._check_length(len(prompt), "prompt", "tokens")
        return await self.in_thread(self.llm.encode, prompt)

    def _check_length(self, length: int, where: str, unit: str) -> None:
        from runtime.errors import InvalidRequestError

        limit = self.max_model_len - 1 if unit == "tokens" else self.max_prompt_chars
        if limit is not None and length > limit:
            raise InvalidRequestError(f"{where} has {length} {unit}, more than fit this artifact's max_model_len of "
                                      f"{self.max_model_len} tokens (at most {limit} {unit}); shorten it")

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        from runtime.errors import InvalidRequestError

        if self.chat_tokenizer is None:
            raise InvalidRequestError("this artifact has no tokenizer.json, so it cannot take chats; use "
                                      "/v1/completions with token ids")
        if self.chat_tokenizer.chat_template is None:
            raise InvalidRequestError("this artifact's tokenizer has no chat template; restart the server with "
                                      "--chat-template FILE, or use /v1/completions")
        text = await self.in_thread(self.chat_tokenizer.apply_chat_template, messages)
        self._check_length(len(text), "messages", "characters")
        return await self.in_thread(
            lambda: self.llm.encode(self.chat_tokenizer.encode(text, add_special_tokens=False), "messages"))

    async def start(self, prompt_ids: list[int], params: Any, endpoint: str) -> AsyncStream:
        """The request in the engine (an InvalidRequestError when it cannot run), as an AsyncStream of
        deltas (runtime/async_llm.py). Closing the stream early (client gone, cancelled task) cancels the
        request and frees its blocks; each completion's outcome goes to the metrics once it is over."""
        self.metrics.server_queue += 1
        try:
            stream = await self.async_llm.add_request(prompt_ids, params)
        finally:
            self.metrics.server_queue -= 1
        started = time.perf_counter()

        def record(outputs: list[RequestOutput | None]) -> None:
            for output in outputs:
                self.metrics.record(endpoint, output, time.perf_counter() - started)

        stream.on_close(record)
        return stream


def default_request_bytes(max_model_len: int, vocab_size: int) -> int:
    """4 MiB of JSON for text prompts and chats (about a million tokens of English, beyond any context
    served here), plus the longest token-id prompt the context allows, each id written as `12345, `."""
    return 4 * MIB + max_model_len * (len(str(vocab_size - 1)) + 2)


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters the longest vocabulary entry (added tokens too) spans: a byte-level entry has one character
    per byte, and a decoded character is at least one byte, so no token of any text is longer."""
    return max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def load_model(config: ServeConfig) -> ServedModel:
    """The config's LLM, ready to serve (one-line UnispecError when the artifact or a bound is unusable)."""
    from runtime.llm import LLM

    kv = None if config.kv_memory_mib is None else config.kv_memory_mib * MIB
    llm = LLM(config.artifact_dir, backend=config.backend, max_model_len=config.max_model_len, kv_memory_bytes=kv,
              speculation=config.speculation)
    bound = llm.manifest.max_batch_size
    if config.max_batch_size is not None and config.max_batch_size > bound:
        raise UnispecError(f"--max-batch-size {config.max_batch_size} is above this artifact's max_batch_size "
                           f"{bound}; lower it or re-export with `unispec export --max-batch-size`")
    template = config.chat_template.read_text() if config.chat_template is not None else None
    return ServedModel(llm, name=config.model_name, max_batch_size=config.max_batch_size or bound,
                       chat_template=template, max_request_bytes=config.max_request_bytes)


def require_serve_extra() -> None:
    """One line naming the extra when the server's libraries are missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        from runtime.errors import BackendUnavailableError

        raise BackendUnavailableError(f"unispec serve needs {', '.join(missing)}; pip install -e '.[serve]'")
