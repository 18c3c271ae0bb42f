"""The generation API: `LLM(artifact_dir)` with `generate` and `stream` (DESIGN.md §7).

    from unispec import LLM, SamplingParams
    llm = LLM("artifacts/eagle3")
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=64))
    for text in llm.stream([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32)):
        print(text, end="")
    outputs[0].outputs[0].text                  # vLLM's shape; SamplingParams(n=2) gives two completions
    llm.chat([{"role": "user", "content": "Hi"}])   # through the artifact's chat template

Without params, `generate` / `stream` / `chat` use `get_default_sampling_params()`: the model creator's
`generation_config.json` sampling fields, as vLLM applies them (runtime/generation_config.py).

A prompt is a string, a list of token ids, or a chat (a list of {"role", "content"} messages, rendered by
the tokenizer's chat template). The LLM reads only the artifact directory: the manifest sizes the pools
and the step buffers, the tokenizer (when the artifact has tokenizer.json) turns text into ids and back.

Thread safety: one lock guards the engine. A caller waiting for its requests takes the lock and runs
one step for every request in flight, whoever submitted it, then lets the next caller in; so threads
calling `generate` / iterating streams at the same time share batches (continuous batching), and each
gets exactly its own outputs. A step that fails raises in the thread that ran it, which cancels its own
requests; the others carry on with the next step. A request is checked, and its grammar compiled, in its
caller's thread before the lock is taken (runtime/structured.py bounds how long that may take).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from threading import RLock
from typing import Any

from runtime.artifact_check import check_artifact, check_step_memory
from runtime.backends import load_backend
from runtime.blocks import num_blocks_for_budget
from runtime.engine import Engine, RequestOutput, bounded
from runtime.errors import ArtifactError, InvalidRequestError, UnispecError
from runtime.generation_config import sampling_defaults
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from runtime.sequence import TokenLogprobs, validate_prompt
from runtime.speculation_record import RecordFile
from runtime.structured import GrammarCompiler
from runtime.tokenizer import TOKENIZER_FILE, TextTokenizer

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "LLM", "Stream"]

DEFAULT_KV_MEMORY_BYTES = 256 * 2**20
MAX_NUM_BLOCKS = 2**31 - 1               # block ids stay int32 for kernels that index pools with them

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
Params = SamplingParams | Sequence[SamplingParams] | None


@dataclass
class _Tracker:
    """What a caller has received of one request so far (filled by the engine's listener)."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)      # a stream's text deltas, final as they arrive
    output: RequestOutput | None = None
    # the engine's own list of the request's log-probability entries (SamplingParams.logprobs), at least as
    # long as token_ids at any moment; None when not collected
    logprobs: list[TokenLogprobs] | None = None


class _Trackers(dict):
    """request id -> _Tracker, and the engine's listener that fills them."""

    def on_update(self, request_id: Hashable, token_ids: list[int], text: str, output: RequestOutput | None) -> None:
        tracker = self.get(request_id)
        if tracker is not None:
            tracker.token_ids.extend(token_ids)
            if text:
                tracker.text.append(text)
            if output is not None:
                tracker.output = output


class LLM:
    def __init__(self, artifact_dir: str | Path, backend: str = "ort", *, num_blocks: int | None = None,
                 kv_memory_bytes: int | None = None, max_model_len: int | None = None,
                 prefill_chunk: int | None = None, step_memory_bytes: int | None = None,
                 speculation: str = "auto", **backend_options: Any) -> None:
        """`num_blocks` sizes the KV pools directly; otherwise `kv_memory_bytes` (default 256 MiB) does,
        counting target and draft pools, capped at what a full batch of max_model_len requests can use.
        `max_model_len` may lower the artifact's; `prefill_chunk` caps the tokens a prompt feeds per step;
        `step_memory_bytes` (default 8 GiB) bounds the persistent step buffers the artifact's sizes ask for.
        `speculation`: "auto" runs each step speculatively or target-only, whichever its measurements say
        is faster (artifacts with a target-only graph), starting from what earlier LLMs on this machine measured
        (runtime/speculation_record.py; UNISPEC_SPECULATION_RECORD=off to start afresh); "always" / "never"
        force one (runtime/speculation.py).
        The artifact and every setting are checked before anything is allocated (runtime/artifact_check.py)."""
        self.artifact_dir = Path(artifact_dir)
        if not self.artifact_dir.is_dir():
            raise ArtifactError(f"{artifact_dir}: no such directory; pass an artifact written by `unispec export`")
        self.manifest = m = Manifest.load(self.artifact_dir)
        check_artifact(self.artifact_dir, m)
        check_step_memory(m, _setting("step_memory_bytes", step_memory_bytes))
        bounded("max_model_len", max_model_len, m.max_model_len, lower=2)
        self.num_blocks = num_blocks = _pool_blocks(m, num_blocks, kv_memory_bytes, max_model_len)
        self.tokenizer = TextTokenizer.from_dir(self.artifact_dir)
        self.sampling_defaults = sampling_defaults(self.artifact_dir)     # a bad file fails here, in one line
        self.backend = load_backend(backend, self.artifact_dir, m, num_blocks=num_blocks, **backend_options)
        # the engine's listener is the trackers' method, not this LLM's: no cycle through the engine, so an LLM
        # let go of frees its sessions and pools at once, not at the cyclic collector's next pass
        self._trackers = _Trackers()
        grammars = None if self.tokenizer is None else \
            GrammarCompiler(self.tokenizer.backend, m.vocab_size, m.tokenizer.eos_token_ids)
        self.engine = Engine(self.backend, eos_token_ids=m.tokenizer.eos_token_ids,
                             detokenize=self.tokenizer.decode if self.tokenizer is not None else None,
                             prefill_chunk=prefill_chunk, max_model_len=max_model_len, grammars=grammars,
                             listener=self._trackers.on_update, speculation=speculation,
                             record=_speculation_record(self.artifact_dir, m, speculation, backend, backend_options))
        self._lock = RLock()
        # ids of streams collected unread: cancelled by the next caller under the lock (a finalizer may run
        # in the middle of a step, where cancelling is not safe)
        self._abandoned: deque[Hashable] = deque()

    # --- prompts ------------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, where: str = "prompt") -> list[int]:
        """A prompt as token ids: text through the tokenizer, chats through its template, ids as given."""
        ids = self._token_ids(prompt, where)
        validate_prompt(ids, self.manifest, where, self.engine.max_model_len)
        return ids

    def _token_ids(self, prompt: Prompt, where: str) -> list[int]:
        if isinstance(prompt, str) or _is_chat(prompt):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{where} is text but this artifact has no {TOKENIZER_FILE}; "
                                          "pass token ids instead")
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else self.tokenizer.encode_chat(prompt)
        if isinstance(prompt, Sequence):
            return list(prompt)
        raise InvalidRequestError(f"{where} is a {type(prompt).__name__}; pass a string, a list of token ids "
                                  "or a list of chat messages")

    def _submit(self, prompts: list[Prompt], params: list[SamplingParams], *, stream: bool = False) -> list[Hashable]:
        """Check every request (once), then queue them all (nothing is queued when one is bad). A prompt
        whose params ask for n completions is n requests, in order (completion i: `params.for_completion(i)`).

        The checks, grammar compilation included, run in the caller's thread without the lock: a constraint
        that takes seconds to compile must not stall the steps of the requests already running."""
        encoded = [self._token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        checked = [self.engine.check_request(ids, sp.for_completion(c), f"prompt {i}")
                   for i, (ids, sp) in enumerate(zip(encoded, params)) for c in range(sp.n)]
        with self._lock:
            self._reap()
            request_ids = []
            try:
                for request in checked:
                    request_ids.append(self.engine.add_checked(request, stream=stream))
                    self._trackers[request_ids[-1]] = _Tracker(logprobs=self.engine.logprobs_of(request_ids[-1]))
            except BaseException:
                self._cancel(request_ids)
                raise
        return request_ids

    # --- generation ---------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Every prompt and parameter set is checked before anything runs, so one bad request fails the
        call without starting the others. `sampling_params` (vLLM's name) is one SamplingParams for all or
        one per prompt; with n > 1, an output's `outputs` holds its n completions.
        """
        prompts = _prompt_list(prompts)
        params = _params_for(self._or_default(sampling_params), len(prompts))
        request_ids = self._submit(prompts, params)
        trackers = [self._trackers[r] for r in request_ids]
        try:
            self._drive(lambda: all(t.output is not None for t in trackers))
        finally:
            self._cancel(request_ids)        # after an error, leave nothing behind for the next call
        outputs, grouped = [t.output for t in trackers], []
        for sp in params:                    # a prompt's n completions are n consecutive requests
            parts, outputs = outputs[:sp.n], outputs[sp.n:]
            grouped.append(parts[0] if sp.n == 1 else RequestOutput.of_completions(parts))
        return grouped

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: Params = None) -> list[RequestOutput]:
        """`generate` for one conversation (a list of {"role", "content"} messages) or a list of them, each
        rendered by the artifact's chat template (see `apply_chat_template`)."""
        chats = [messages] if _is_chat(messages) else list(messages) if isinstance(messages, Sequence) else None
        if not chats or not all(_is_chat(c) for c in chats):
            raise InvalidRequestError("LLM.chat takes a conversation (a non-empty list of {'role', 'content'} "
                                      "dicts) or a list of conversations")
        return self.generate(chats, sampling_params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Submit one request now; iterate the result for text deltas (token-id lists without a tokenizer)."""
        params = self._or_default(params)
        if params.n != 1:
            raise InvalidRequestError(f"LLM.stream streams one completion; for n={params.n} use LLM.streams "
                                      "(one Stream per completion) or runtime.async_llm.AsyncLLM")
        return self.streams(prompt, params)[0]

    def streams(self, prompt: Prompt, params: SamplingParams | None = None) -> list[Stream]:
        """Submit the prompt's `params.n` completions now (all or none); one Stream per completion."""
        params = self._or_default(params)
        request_ids = self._submit([prompt], [params], stream=self.tokenizer is not None)
        return [Stream(self, r, self._trackers[r], params.for_completion(c)) for c, r in enumerate(request_ids)]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the artifact's generation_config.json sampling fields (vLLM's defaults)."""
        return SamplingParams(**self.sampling_defaults)

    def _or_default(self, params: Params) -> SamplingParams | Sequence[SamplingParams]:
        return self.get_default_sampling_params() if params is None else params

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError(f"a chat needs the artifact's {TOKENIZER_FILE} and chat template; this "
                                      "artifact has no tokenizer")
        return self.tokenizer.apply_chat_template(messages)

    # --- the shared engine ----------------------------------------------------------------------------------

    def _drive(self, done: Callable[[], bool]) -> None:
        """Run steps (for everyone's requests) until `done()` holds."""
        while True:
            with self._lock:
                self._reap()
                if done():
                    return
                steps = self.engine.num_steps
                self.engine.step()
                if self.engine.num_steps == steps and not done():
                    raise UnispecError("the engine scheduled nothing while requests wait; this is a bug, "
                                       "please report it with the LLM's settings")

    def _reap(self) -> None:
        """Cancel the streams collected unread (with the lock held): they must stop using steps and blocks."""
        while self._abandoned:
            self._cancel([self._abandoned.popleft()])

    def _cancel(self, request_ids: Sequence[Hashable]) -> None:
        with self._lock:
            for request_id in request_ids:
                self.engine.abort(request_id)
                self._trackers.pop(request_id, None)


class Stream:
    """One streamed request. Iterate once for deltas; `output` holds the RequestOutput once finished.

    Leaving the iteration early (break, an exception, `cancel()` / `close()`) cancels the request and frees
    its blocks; so does dropping a stream that was never iterated (when it is garbage collected).
    """

    def __init__(self, llm: LLM, request_id: Hashable, tracker: _Tracker, params: SamplingParams) -> None:
        self.request_id = request_id
        self._llm, self._tracker, self._params = llm, tracker, params
        self._collected = weakref.finalize(self, llm._abandoned.append, request_id)

    @property
    def output(self) -> RequestOutput | None:
        return self._tracker.output

    @property
    def token_ids(self) -> list[int]:
        """The tokens committed so far (a copy; the final output's token_ids once finished)."""
        return list(self._tracker.token_ids)

    def logprobs(self, start: int, stop: int) -> list[TokenLogprobs] | None:
        """The log-probability entries of token_ids[start:stop] (None unless SamplingParams.logprobs)."""
        collected = self._tracker.logprobs
        return None if collected is None else collected[start:stop]

    def cancel(self) -> None:
        """Stop the request now (its output, finish_reason "cancelled", keeps what was generated)."""
        self._collected.detach()
        self._llm._cancel([self.request_id])

    close = cancel

    def __iter__(self) -> Iterator[str] | Iterator[list[int]]:
        tracker, as_text = self._tracker, self._llm.tokenizer is not None
        sent_tokens, sent_texts, sent_text = 0, 0, ""
        try:
            while True:
                seen = len(tracker.token_ids)
                self._llm._drive(lambda seen=seen: tracker.output is not None or len(tracker.token_ids) > seen)
                # Other threads' steps advance this request outside our lock: read "finished" before the
                # tokens and text, and count what was read rather than what is there later, so nothing is skipped.
                finished = tracker.output is not None
                new_tokens = [] if as_text else tracker.token_ids[sent_tokens:]
                if new_tokens:
                    sent_tokens += len(new_tokens)
                    yield new_tokens
                texts = self._new_text(sent_texts)
                sent_texts += len(texts)
                delta = "".join(texts)
                if finished:
                    final = tracker.output.text
                    delta = final[len(sent_text):] if final.startswith(sent_text) else ""
                if as_text and delta:
                    yield delta
                    sent_text += delta
                if finished:
                    return
        finally:
            self.cancel()                        # a no-op once finished; also forgets the tracker

    def _new_text(self, sent: int) -> list[str]:
        """The text deltas handed over since the first `sent`: the engine hands over only text that can no
        longer change (runtime/detokenizer.py); the final text may add what was held back, or cut a tail
        that turned into a stop string."""
        return self._tracker.text[sent:]


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0 \
        and all(isinstance(m, Mapping) for m in prompt)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or _is_chat(prompts):
        return [prompts]                        # one text or one chat
    if not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts is a {type(prompts).__name__}; pass a string, a token-id list, a "
                                  "chat, or a list of them")
    if not prompts:
        raise InvalidRequestError("prompts is empty; pass a string, a token-id list, a chat, or a list of them")
    if not isinstance(prompts[0], (str, Sequence)):
        return [prompts]                        # one token-id list
    return list(prompts)


def _params_for(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidRequestError(f"params must be one SamplingParams or one per prompt ({n}); got "
                                  f"{len(params)} items")
    return params


def _speculation_record(artifact_dir: Path, m: Manifest, speculation: str, backend: str,
                        options: Mapping[str, Any]) -> RecordFile | None:
    """Where `auto` keeps what it learns about this artifact on this machine (runtime/speculation_record.py);
    None when nothing is to be learned (a forced mode, a `none` artifact, no target-only graph)."""
    if speculation != "auto" or not m.num_speculative_tokens or m.target_only is None:
        return None
    return RecordFile.for_artifact(artifact_dir, m.num_speculative_tokens, backend, options)


def _setting(name: str, value: int | None) -> int | None:
    """A byte budget: None (the default) or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(f"{name}={value!r} is invalid; use an int >= 1 (bytes)")
    return value


def _pool_blocks(m: Manifest, num_blocks: int | None, kv_memory_bytes: int | None, max_model_len: int | None) -> int:
    if num_blocks is None:
        budget = _setting("kv_memory_bytes", kv_memory_bytes)
        num_blocks = num_blocks_for_budget(m, DEFAULT_KV_MEMORY_BYTES if budget is None else budget, max_model_len)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
        raise InvalidRequestError(f"num_blocks={num_blocks!r} is invalid; use an int in [1, {MAX_NUM_BLOCKS}]")
    return num_blocks
