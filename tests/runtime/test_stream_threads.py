"""Stream under other threads' steps: whatever lands between a stream reading its request and yielding is
delivered later, never skipped. `unispec serve` iterates many streams from worker threads, where another
stream's step routinely finishes this one in that window; these tests force that interleaving."""

from __future__ import annotations

import threading

from runtime.llm import LLM, Stream
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX

CASE = "llama3-eagle3"
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _finish_elsewhere(stream: Stream) -> None:
    """Another thread drives the engine until the stream's request is done (as a concurrent stream would)."""
    worker = threading.Thread(target=stream._llm._drive, args=(lambda: stream.output is not None,))
    worker.start()
    worker.join(timeout=60)
    assert stream.output is not None


def test_token_ids_committed_while_the_consumer_holds_a_chunk_are_not_skipped(tiny_artifact) -> None:
    llm = LLM(tiny_artifact(CASE).path, num_blocks=64)
    want = llm.generate([[5, 6, 7]], PARAMS)[0].token_ids
    stream, got = llm.stream([5, 6, 7], PARAMS), []
    for chunk in stream:
        got += chunk
        if stream.output is None:
            _finish_elsewhere(stream)        # the rest is committed before the generator resumes
    assert got == want


def test_text_read_just_before_another_thread_finishes_the_request_is_completed(tiny_artifact, monkeypatch) -> None:
    llm = LLM(tiny_artifact(CASE + JSON_SUFFIX).path, num_blocks=64)
    want = llm.generate(["hello"], PARAMS)[0].text
    stream, original = llm.stream("hello", PARAMS), Stream._new_text

    def stale_then_finished(self: Stream, sent: int) -> list[str]:
        text = original(self, sent)          # read while unfinished ...
        if self.output is None:
            _finish_elsewhere(self)          # ... then another thread's step ends the request
        return text

    monkeypatch.setattr(Stream, "_new_text", stale_then_finished)
    assert "".join(stream) == want and want

