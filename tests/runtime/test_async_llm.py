"""The vLLM-shaped API over LLM: n completions (completion i seeded seed + i), LLM.chat, generation_config.json
defaults, and AsyncLLM: its deltas add up to LLM.generate's outputs, n > 1 interleaves completions by index,
and closing a stream early or cancelling its task cancels the requests and frees their KV blocks."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from runtime.async_llm import AsyncLLM
from runtime.errors import InvalidRequestError
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX

CASE = "llama3-eagle3" + JSON_SUFFIX
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=5, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_artifact) -> LLM:
    # speculating always: seeded outputs must not depend on what else shares the batch (see test_llm.py)
    return LLM(tiny_artifact(CASE).path, num_blocks=96, speculation="always")


def test_n_completions_are_seeded_seed_plus_their_index(llm: LLM) -> None:
    alone = [llm.generate([[7, 8, 9]], SamplingParams(**{**_fields(SAMPLED), "seed": 5 + i}))[0].token_ids
             for i in range(3)]
    outs = llm.generate([[7, 8, 9], [10, 11]], SamplingParams(**{**_fields(SAMPLED), "n": 3}))
    assert [c.token_ids for c in outs[0].outputs] == alone and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert outs[0].token_ids == alone[0] and len(outs[1].outputs) == 3      # each prompt gets its n
    assert len({tuple(t) for t in alone}) > 1                              # the seeds differ, so do the samples
    assert llm.engine.blocks.num_free == llm.num_blocks
    with pytest.raises(InvalidRequestError, match="for n=2 use LLM.streams"):
        llm.stream("hello", SamplingParams(n=2))
    with pytest.raises(InvalidRequestError, match="SamplingParams.n=0"):
        SamplingParams(n=0)


def test_chat_applies_the_template_to_one_or_many_conversations(llm: LLM) -> None:
    hello, bye = [{"role": "user", "content": "hello"}], [{"role": "user", "content": "bye"}]
    (one,) = llm.chat(hello, GREEDY)
    assert one.prompt_token_ids == llm.tokenizer.encode(llm.apply_chat_template(hello), add_special_tokens=False)
    assert one.token_ids == llm.generate([hello], GREEDY)[0].token_ids
    assert [o.prompt_token_ids for o in llm.chat([hello, bye], GREEDY)] == [llm.encode(hello), llm.encode(bye)]
    with pytest.raises(InvalidRequestError, match="LLM.chat takes a conversation"):
        llm.chat("hello")


def test_generation_config_gives_the_defaults(tiny_artifact, tmp_path) -> None:
    artifact = tmp_path / "with-defaults"
    shutil.copytree(tiny_artifact(CASE).path, artifact)
    (artifact / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7, "do_sample": True}))
    llm = LLM(artifact, num_blocks=32)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=7)
    # greedy by the file's temperature: the same tokens every time (at the default 1.0, a fresh stream each call)
    want = llm.generate([[7, 8, 9]], SamplingParams(temperature=0.0, top_k=7))[0].token_ids
    assert llm.generate([[7, 8, 9]])[0].token_ids == want and llm.chat([{"role": "user", "content": "a"}])
    assert "".join(llm.stream([7, 8, 9])) == llm.tokenizer.decode(want)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "top_p", "max_tokens", "seed", "ignore_eos")}


async def _collect(async_llm: AsyncLLM, prompt, params) -> dict[int, tuple[str, list[int], object]]:
    got: dict[int, tuple[str, list[int], object]] = {}
    async for delta in async_llm.generate(prompt, params):
        text, ids, _ = got.get(delta.index, ("", [], None))
        got[delta.index] = (text + delta.text, ids + delta.token_ids, delta.output)
    return got


def test_async_deltas_add_up_to_generate(llm: LLM) -> None:
    want = llm.generate(["hello world"], SamplingParams(**{**_fields(SAMPLED), "n": 2}))[0]

    async def run() -> dict:
        return await _collect(AsyncLLM(llm), "hello world", SamplingParams(**{**_fields(SAMPLED), "n": 2}))

    got = asyncio.run(run())
    assert sorted(got) == [0, 1]
    for index, (text, ids, output) in got.items():
        completion = want.outputs[index]
        assert (text, ids) == (completion.text, completion.token_ids) and output.token_ids == completion.token_ids
    assert llm.engine.blocks.num_free == llm.num_blocks and not llm._trackers


def test_closing_early_or_cancelling_frees_the_blocks(llm: LLM) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, n=2)

    async def run() -> list:
        async_llm = AsyncLLM(llm, max_concurrency=4)
        closed = asyncio.get_running_loop().create_future()
        stream = await async_llm.add_request([7, 8, 9], long)
        stream.on_close(closed.set_result)
        async for _ in stream:
            break
        await stream.aclose()
        outputs = await asyncio.wait_for(closed, 30)

        async def consume() -> None:
            async for _ in async_llm.generate([4, 5, 6], long):
                pass

        task = asyncio.create_task(consume())
        while not llm.engine.has_unfinished():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):                        # the cleanup runs on a worker thread
            if not llm.engine.has_unfinished() and async_llm._slots._value == 4:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequestError, match="n=5 is more completions"):
            await async_llm.add_request([1, 2], SamplingParams(n=5))
        return outputs

    outputs = asyncio.run(run())
    assert [o.finish_reason for o in outputs] == ["cancelled", "cancelled"]
    assert all(len(o.token_ids) < 100 for o in outputs)       # of up to 125 (max_model_len 128)
    assert llm.engine.blocks.num_free == llm.num_blocks and not llm.engine.has_unfinished() and not llm._trackers
