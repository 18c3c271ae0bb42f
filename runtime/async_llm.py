"""The asyncio API over an LLM: `AsyncLLM(llm)`, whose `generate` yields a request's deltas on the event loop.

    async_llm = AsyncLLM(LLM("artifacts/eagle3"))
    async for delta in async_llm.generate("Hello", SamplingParams(max_tokens=32, n=2)):
        print(delta.index, delta.text, delta.output)     # output: the completion's RequestOutput, at its end

The LLM is blocking and guarded by one lock; a thread waiting for its request's next tokens runs one step
for every request in flight (runtime/llm.py). So each open request waits for its deltas in a worker thread,
never on the event loop, and all of them share one continuous batch. At most `max_concurrency` requests
(completions: n > 1 counts n) are in the engine at once; later ones wait, first come first served.

Closing a stream early (the consumer breaks, its task is cancelled, a server's client goes away) cancels
its requests, which frees their KV blocks at once. Closing never awaits: under a cancelled task (Starlette
cancels a streaming reply's task group level-triggered, so every await in it raises again) the cleanup
is handed to a worker thread, which runs it once the request's pending wait returns.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.llm import LLM, Prompt, Stream
from runtime.sampling_params import SamplingParams
from runtime.sequence import RequestOutput, TokenLogprobs

__all__ = ["AsyncLLM", "AsyncStream", "Delta"]


@dataclass(frozen=True)
class Delta:
    """What one completion of a request produced since its previous delta."""

    index: int                                        # which completion: 0 .. n-1
    text: str = ""                                    # new final text ("" without a tokenizer)
    token_ids: list[int] = field(default_factory=list)   # tokens committed since the previous delta
    output: RequestOutput | None = None               # the completion's whole output, on its last delta
    # one entry per token of token_ids when SamplingParams.logprobs is set (runtime/sequence.py), else None
    logprobs: list[TokenLogprobs] | None = None


class AsyncLLM:
    def __init__(self, llm: LLM, *, max_concurrency: int | None = None) -> None:
        """`max_concurrency`: requests in the engine at once (default: the artifact's max_batch_size)."""
        self.llm = llm
        self.max_concurrency = max_concurrency or llm.manifest.max_batch_size
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self._admission = asyncio.Lock()          # one request takes its n slots at a time: no deadlock
        # one thread per request in the engine (each waits for its own deltas), plus a few for encoding
        self._threads = ThreadPoolExecutor(self.max_concurrency + 4, thread_name_prefix="unispec-async")
        self.num_waiting = 0                      # requests waiting for slots

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker thread (for blocking LLM calls: encoding, templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> AsyncStream:
        """Queue the request (its n completions) once slots free up; InvalidRequestError when it cannot
        run. Iterate the result for Delta objects; close it to cancel what is left."""
        params = self.llm.get_default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params is a {type(params).__name__}; pass a SamplingParams")
        if params.n > self.max_concurrency:
            raise InvalidRequestError(f"n={params.n} is more completions than run at once here "
                                      f"({self.max_concurrency}); lower n")
        await self._acquire(params.n)
        loop = asyncio.get_running_loop()
        submitted = loop.run_in_executor(self._threads, self.llm.streams, prompt, params)
        try:
            streams = await asyncio.shield(submitted)
        except asyncio.CancelledError:        # the request may still get in: cancel it when it does
            submitted.add_done_callback(lambda f: _abandon(f, self, params.n))
            raise
        except BaseException:
            self._release(params.n)
            raise
        return AsyncStream(self, streams)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """The request's deltas, each completion's last one with its RequestOutput (see `add_request`)."""
        async with aclosing(await self.add_request(prompt, sampling_params)) as stream:
            async for delta in stream:
                yield delta

    async def _acquire(self, n: int) -> None:
        self.num_waiting += 1
        taken = 0
        try:
            async with self._admission:
                while taken < n:
                    await self._slots.acquire()
                    taken += 1
        except BaseException:
            self._release(taken)              # the slot being waited for when cancelled was not taken
            raise
        finally:
            self.num_waiting -= 1

    def _release(self, n: int) -> None:
        for _ in range(n):
            self._slots.release()


class AsyncStream:
    """A request's completions in flight: async-iterate for Delta objects (completions interleave, round
    robin); `close()` / `aclose()` cancels what has not finished. `outputs` holds each completion's
    RequestOutput once it is closed; `on_close` callbacks get them."""

    def __init__(self, owner: AsyncLLM, streams: list[Stream]) -> None:
        self._owner, self._streams = owner, streams
        self._iters = [iter(s) for s in streams]
        self._locks = [threading.Lock() for _ in streams]    # a completion's iterator: one thread at a time
        self._sent = [0] * len(streams)
        self._closed = False
        self._callbacks: list[Callable[[list[RequestOutput | None]], None]] = []

    @property
    def outputs(self) -> list[RequestOutput | None]:
        return [s.output for s in self._streams]

    def on_close(self, callback: Callable[[list[RequestOutput | None]], None]) -> None:
        """Call `callback(outputs)` on the event loop once the stream is closed and its requests are over."""
        self._callbacks.append(callback)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        live = list(range(len(self._streams)))
        while live and not self._closed:
            for i in list(live):
                delta = await self._owner.run(self._next, i)
                if delta.output is not None:
                    live.remove(i)
                if delta.text or delta.token_ids or delta.output is not None:
                    yield delta

    def _next(self, i: int) -> Delta:
        """(worker thread) Completion i's next delta; its last carries the output."""
        with self._locks[i]:
            item = next(self._iters[i], None)
            ids = self._streams[i].token_ids
        logprobs = self._streams[i].logprobs(self._sent[i], len(ids))
        new_ids, self._sent[i] = ids[self._sent[i]:], len(ids)
        if item is None:
            return Delta(i, "", new_ids, self._streams[i].output, logprobs)
        return Delta(i, item if isinstance(item, str) else "", new_ids, logprobs=logprobs)

    def close(self) -> None:
        """Cancel what has not finished (on a worker thread: cancelling takes the LLM's lock) and free the
        slots once done. Returns at once; safe to call again."""
        if self._closed:
            return
        self._closed = True
        owner = self._owner
        done = asyncio.get_running_loop().run_in_executor(owner._threads, self._cancel_all)
        done.add_done_callback(lambda _: self._finished())

    async def aclose(self) -> None:
        self.close()

    def _cancel_all(self) -> None:
        for stream, iterator, lock in zip(self._streams, self._iters, self._locks):
            stream.cancel()                   # a no-op once finished; makes a pending wait return
            with lock:
                iterator.close()

    def _finished(self) -> None:
        self._owner._release(len(self._streams))
        for callback in self._callbacks:
            callback(self.outputs)


def _abandon(submitted: asyncio.Future, owner: AsyncLLM, n: int) -> None:
    """A submission whose caller was cancelled: cancel its requests (if they got in) and free the slots."""
    if submitted.cancelled() or submitted.exception() is not None:
        owner._release(n)
        return
    AsyncStream(owner, submitted.result()).close()
