"""LLM: strings, id lists and chats in, tokens + text + metrics out; stop conditions; pool sizing; one-line
errors for bad requests (after which the LLM still serves) and for damaged artifacts; streaming (text as
it is committed, never a stop string; breaking out cancels); several threads at once; relaxed thinking
only on request; a failing step fails the call and leaves nothing behind; an LLM let go frees its backend at
once."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import weakref

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from runtime import manifest as io
from runtime.errors import ArtifactError, InvalidRequestError, UnispecError
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import ASSISTANT, BOS, END_THINK, JSON_SUFFIX, THINK, USER

CASE = "llama3-eagle3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokenizer(vocab_size: int) -> Tokenizer:
    """Word-level: "w<id>" is token <id>; 0-2 are special (<unk>, <s>, </s>) and vanish from decoded text."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


def _copy(source, target, *, tokenizer: bool = True, eos: tuple[int, ...] | None = None):
    shutil.copytree(source, target)
    d = json.loads((target / io.MANIFEST_NAME).read_text())
    if tokenizer:
        _tokenizer(d["vocab_size"]).save(str(target / "tokenizer.json"))
    else:
        (target / "tokenizer.json").unlink(missing_ok=True)
    if eos is not None:
        d["tokenizer"]["eos_token_ids"] = list(eos)
        (target / io.MANIFEST_NAME).write_text(json.dumps(d))
    return target


@pytest.fixture(scope="module")
def artifact(tiny_artifact, tmp_path_factory):
    return _copy(tiny_artifact(CASE).path, tmp_path_factory.mktemp("llm") / "artifact")


# The tiny random drafts never pay, so speculation="auto" would decode target-only; these tests are about the
# speculative pipeline (and its seeded outputs, which "auto" lets depend on the batch), so they speculate always.
@pytest.fixture(scope="module")
def llm(artifact) -> LLM:
    return LLM(artifact, num_blocks=128, speculation="always")


def test_strings_and_id_lists_give_tokens_text_and_metrics(llm: LLM) -> None:
    outs = llm.generate(["w5 w17 w33 w64", [9, 8, 7, 6, 5, 4, 3]], GREEDY)
    assert outs[0].prompt_token_ids == [5, 17, 33, 64] and outs[1].prompt_token_ids == [9, 8, 7, 6, 5, 4, 3]
    for out in outs:
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)
        m = out.metrics
        assert m.num_generated == 12 and m.tokens_per_s > 0 and m.elapsed_s > 0
        assert len(m.acceptance_per_position) == llm.manifest.num_speculative_tokens
        assert sum(a + 1 for a in m.accepted_per_step) >= 11      # the first token comes from the prefill
    assert llm.engine.blocks.num_free == llm.num_blocks


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], sampled)[0].token_ids
    batch = llm.generate([[40, 41], [11, 12, 13], [90] * 9],
                         [SamplingParams(temperature=1.0, seed=1), sampled, GREEDY])
    assert batch[1].token_ids == alone
    assert llm.generate([[11, 12, 13]], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=8,
                                                       ignore_eos=True))[0].token_ids != alone


def _first_new_token(tokens: list[int], start: int = 3) -> int:
    """Index of the first token at or after `start` that does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    prompt = [21, 22, 23, 24, 25]
    full = llm.generate([prompt], GREEDY)[0].token_ids
    i = _first_new_token(full)
    stop_id = SamplingParams(temperature=0.0, max_tokens=12, stop=[full[i]], ignore_eos=True)
    by_id = llm.generate([prompt], stop_id)[0]
    assert by_id.token_ids == full[:i + 1] and by_id.finish_reason == "stop"
    assert by_id.text == llm.tokenizer.decode(full[:i])
    # a stop string that first shows up with token j (not as a prefix of an earlier word)
    j = next(j for j in range(3, len(full)) if f"w{full[j]}" not in llm.tokenizer.decode(full[:j]))
    stop_string = SamplingParams(temperature=0.0, max_tokens=12, stop=f"w{full[j]}", ignore_eos=True)
    by_string = llm.generate([prompt], stop_string)[0]
    assert by_string.finish_reason == "stop" and by_string.token_ids == full[:j + 1]
    assert by_string.text == llm.tokenizer.decode(full[:j]) + " "    # everything before the stop string


def test_eos_stops_unless_ignored(artifact, tmp_path) -> None:
    prompt = [30, 31, 32]
    full = LLM(artifact, num_blocks=64).generate([prompt], GREEDY)[0].token_ids
    i = _first_new_token(full)
    llm = LLM(_copy(artifact, tmp_path / "eos", tokenizer=False, eos=(full[i],)), num_blocks=64)
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert stopped.token_ids == full[:i + 1] and stopped.finish_reason == "stop" and stopped.text == ""
    assert llm.generate([prompt], GREEDY)[0].token_ids == full


def _bad_requests(llm: LLM) -> list[tuple[object, object, str]]:
    too_long = [5] * llm.manifest.max_model_len
    return [
        ([[]], None, "prompt 0 is empty"), ([""], None, "prompt 0 is empty"), ([], None, "prompts is empty"),
        ([[5, llm.manifest.vocab_size]], None, f"[0, {llm.manifest.vocab_size})"),
        ([[5, 6], [-1]], None, "prompt 1 token 0 is -1"), ([too_long], None, "max_model_len"),
        ([[5], [6]], [GREEDY], "one per prompt (2)"), ([[5]], [GREEDY, GREEDY], "one per prompt (1)"),
        ([[5] * 40], SamplingParams(max_tokens=80), "KV blocks"),
    ]


def test_bad_requests_fail_in_one_line_and_the_llm_keeps_serving(artifact) -> None:
    llm = LLM(artifact, num_blocks=24)                    # 24 blocks of 4: a 40 + 80 token request cannot fit
    want = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    for prompts, params, fragment in _bad_requests(llm):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompts, params)
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 24
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams.top_p=1.5 is invalid; use a float in \(0, 1\]"):
        llm.generate([[5, 6, 7]], SamplingParams(top_p=1.5))
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == want


def test_strings_need_a_tokenizer(artifact, tmp_path) -> None:
    llm = LLM(_copy(artifact, tmp_path / "bare", tokenizer=False), num_blocks=64)
    assert llm.tokenizer is None
    with pytest.raises(InvalidRequestError, match="no tokenizer.json; pass token ids"):
        llm.generate(["hello"])
    assert llm.generate([[1, 2]], GREEDY)[0].text == ""


def test_pool_sizing_from_a_byte_budget(artifact) -> None:
    m = io.Manifest.load(artifact)
    block_bytes = m.kv_bytes_per_token() * m.block_size
    per_row = -(-(m.max_model_len + 2 * m.num_speculative_tokens + 1) // m.block_size)
    llm = LLM(artifact, kv_memory_bytes=(per_row + 3) * block_bytes + 5)
    assert llm.num_blocks == per_row + 3
    assert all(p.shape[0] == llm.num_blocks for p in llm.backend.pools.values())
    assert LLM(artifact).num_blocks == min(256 * 2**20 // block_bytes, m.max_batch_size * per_row)
    with pytest.raises(InvalidRequestError, match="raise kv_memory_bytes or pass num_blocks"):
        LLM(artifact, kv_memory_bytes=block_bytes * (per_row - 1))


@pytest.mark.parametrize("damage", ["no dir", "bad json", "no model", "no weights", "bad tokenizer"])
def test_damaged_artifacts_fail_in_one_line(damage: str, artifact, tmp_path) -> None:
    path = _copy(artifact, tmp_path / "copy", tokenizer=True)
    manifest = json.loads((path / io.MANIFEST_NAME).read_text())
    if damage == "no dir":
        path = tmp_path / "missing"
    elif damage == "bad json":
        (path / io.MANIFEST_NAME).write_text('{"method": "none",')
    elif damage == "no model":
        (path / manifest["graphs"][io.STEP].get("ort", io.MODEL_NAME)).unlink()
    elif damage == "no weights":
        if not manifest.get("weights_file"):
            manifest["weights_file"] = io.WEIGHTS_NAME            # an artifact that says it has them
            (path / io.MANIFEST_NAME).write_text(json.dumps(manifest))
        (path / io.WEIGHTS_NAME).unlink(missing_ok=True)
    else:
        (path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ArtifactError) as info:
        LLM(path, num_blocks=8)
    assert "\n" not in str(info.value) and isinstance(info.value, UnispecError)


def test_the_facade_exports_these_classes() -> None:
    import unispec
    from runtime.sampling_params import SamplingParams as Params

    assert unispec.LLM is LLM and unispec.SamplingParams is Params
    assert unispec.AsyncLLM.__module__ == "runtime.async_llm" and unispec.CompletionOutput.__name__ == "CompletionOutput"


# --- streaming, threads, chat, thinking, failures (the artifact with a trained tokenizer) ---------------------

@pytest.fixture(scope="module")
def json_llm(tiny_artifact) -> LLM:
    return LLM(tiny_artifact(CASE + JSON_SUFFIX).path, num_blocks=96, speculation="always")


def test_stream_yields_the_text_as_it_is_committed(json_llm: LLM) -> None:
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=3, max_tokens=16), SamplingParams(
            temperature=0.0, max_tokens=30, json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})):
        want = json_llm.generate(["hello world"], params)[0]
        stream = json_llm.stream("hello world", params)
        deltas = list(stream)
        assert "".join(deltas) == want.text == stream.output.text and all(deltas)
        assert stream.output.token_ids == want.token_ids and len(deltas) > 1
        assert "tokens/s" in stream.output.summary() and "acceptance per position" in stream.output.summary()
    assert json_llm.engine.blocks.num_free == json_llm.num_blocks and not json_llm._trackers


def test_streamed_text_never_shows_a_stop_string(json_llm: LLM) -> None:
    full = json_llm.generate(["the quick"], GREEDY)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3
    stream = json_llm.stream("the quick", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop))
    seen = ""
    for delta in stream:
        seen += delta
        assert stop not in seen
    assert seen == stream.output.text == full[:full.index(stop)] and stream.output.finish_reason == "stop"


def test_stream_without_a_tokenizer_yields_token_ids_and_breaking_out_cancels(artifact, tmp_path) -> None:
    llm = LLM(_copy(artifact, tmp_path / "bare", tokenizer=False), num_blocks=64)
    want = llm.generate([[4, 5, 6]], GREEDY)[0].token_ids
    stream = llm.stream([4, 5, 6], GREEDY)
    assert [t for chunk in stream for t in chunk] == want
    stream = llm.stream([4, 5, 6], GREEDY)
    for _ in stream:
        break
    assert stream.output.finish_reason == "cancelled" and len(stream.output.token_ids) < 12
    assert llm.engine.blocks.num_free == 64 and not llm.engine.has_unfinished()
    never_iterated = llm.stream([4, 5, 6], GREEDY)
    never_iterated.cancel()
    assert never_iterated.output.finish_reason == "cancelled" and never_iterated.output.token_ids == []


def test_threads_share_the_engine_and_each_gets_its_own_outputs(json_llm: LLM) -> None:
    prompts = [[[7 + t, 8 + i, 9] for i in range(3)] for t in range(4)]
    params = [SamplingParams(temperature=0.0 if t % 2 else 0.9, seed=t, max_tokens=10 + t, ignore_eos=True)
              for t in range(4)]
    want = [json_llm.generate(p, sp) for p, sp in zip(prompts, params)]
    streamed_want = json_llm.generate(["hello"], GREEDY)[0].text
    results: dict[int, object] = {}
    barrier = threading.Barrier(5)

    def generate(t: int) -> None:
        barrier.wait()
        results[t] = json_llm.generate(prompts[t], params[t])

    def stream() -> None:
        barrier.wait()
        results[4] = "".join(json_llm.stream("hello", GREEDY))

    threads = [threading.Thread(target=generate, args=(t,)) for t in range(4)] + [threading.Thread(target=stream)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [[o.token_ids for o in results[t]] for t in range(4)] == [[o.token_ids for o in w] for w in want]
    assert results[4] == streamed_want
    assert json_llm.engine.blocks.num_free == json_llm.num_blocks and not json_llm._trackers


def test_chats_go_through_the_chat_template(json_llm: LLM, artifact) -> None:
    chat = [{"role": "user", "content": "hello"}]
    text = json_llm.apply_chat_template(chat)
    assert text == "<s><|user|>hello<|assistant|>"
    ids = json_llm.generate(chat, GREEDY)[0].prompt_token_ids
    assert ids == json_llm.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == BOS and ids[1] == USER and ids[-1] == ASSISTANT
    with pytest.raises(InvalidRequestError, match="needs a chat template"):
        LLM(artifact, num_blocks=16).generate([chat])


class Recording:
    """Keeps every step's in_thinking_phase feed."""

    def __init__(self, inner) -> None:
        self.inner, self.thinking = inner, []
        self.manifest, self.num_blocks, self.pools = inner.manifest, inner.num_blocks, inner.pools

    def input_specs(self):
        return self.inner.input_specs()

    def run(self, feeds):
        self.thinking.append(feeds[io.IN_THINKING_PHASE].tolist())
        return self.inner.run(feeds)

    def commit(self, outputs, slots, rows) -> None:
        self.inner.commit(outputs, slots, rows)


def test_thinking_rows_relax_only_when_the_request_opts_in(tiny_artifact, artifact) -> None:
    llm = LLM(tiny_artifact(CASE + JSON_SUFFIX).path, num_blocks=64, speculation="always")
    assert (llm.manifest.tokenizer.think_start_id, llm.manifest.tokenizer.think_end_id) == (THINK, END_THINK)
    recording = llm.engine.backend = Recording(llm.engine.backend)
    thinking_prompt = [5, 6, THINK, 7]
    llm.generate([thinking_prompt, thinking_prompt, [5, 6, THINK, 7, END_THINK]],
                 [SamplingParams(max_tokens=6, ignore_eos=True, relaxed_thinking=True, seed=1),
                  SamplingParams(max_tokens=6, ignore_eos=True, seed=1),
                  SamplingParams(max_tokens=6, ignore_eos=True, relaxed_thinking=True, seed=1)])
    assert recording.thinking[0] == [True, False, False]          # opted in and inside <think> ... </think>
    # (while all three run: the opted-in row may accept more drafts and finish first)
    assert all(row[1:] == [False, False] for row in recording.thinking if len(row) == 3)
    with pytest.raises(InvalidRequestError, match="relaxed_thinking needs the tokenizer's <think> and </think>"):
        LLM(artifact, num_blocks=16).generate([[1, 2]], SamplingParams(relaxed_thinking=True))


class Failing:
    """A backend whose steps fail while `broken` is set."""

    def __init__(self, inner) -> None:
        self.inner, self.broken = inner, True
        self.manifest, self.num_blocks, self.pools = inner.manifest, inner.num_blocks, inner.pools

    def input_specs(self):
        return self.inner.input_specs()

    def run(self, feeds):
        if self.broken:
            raise RuntimeError("device lost")
        return self.inner.run(feeds)

    def commit(self, outputs, slots, rows) -> None:
        self.inner.commit(outputs, slots, rows)


def test_an_llm_let_go_frees_its_backend_at_once(artifact) -> None:
    """Nothing of the LLM's own refers back to it (the engine's listener is its trackers'), so dropping the
    last reference frees its sessions and pools then, not at the cyclic collector's next pass."""
    gc.disable()
    try:
        llm = LLM(artifact, num_blocks=16)
        llm.generate(["ab"], GREEDY)
        assert [t for chunk in llm.stream([4, 5, 6], GREEDY) for t in chunk]
        gone, backend = weakref.ref(llm), weakref.ref(llm.backend)
        del llm
        assert gone() is None and backend() is None
    finally:
        gc.enable()


def test_a_failing_step_fails_the_call_and_the_llm_keeps_serving(artifact) -> None:
    llm = LLM(artifact, num_blocks=32, speculation="always")       # Failing wraps the speculative graph only
    want = llm.generate([[5, 6, 7], [8]], GREEDY)
    failing = llm.engine.backend = Failing(llm.engine.backend)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([[5, 6, 7], [8]], GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 32 and not llm._trackers
    failing.broken = False
    assert [o.token_ids for o in llm.generate([[5, 6, 7], [8]], GREEDY)] == [o.token_ids for o in want]


def test_bad_settings_and_constraints_fail_before_anything_runs(json_llm: LLM, artifact) -> None:
    with pytest.raises(InvalidRequestError, match=r"max_model_len=500 is invalid; use an int in \[2, 128\]"):
        LLM(artifact, num_blocks=16, max_model_len=500)
    with pytest.raises(InvalidRequestError, match=r"prefill_chunk=0 is invalid"):
        LLM(artifact, num_blocks=16, prefill_chunk=0)
    short = LLM(artifact, num_blocks=16, max_model_len=10)
    with pytest.raises(InvalidRequestError, match="max_model_len is 10"):
        short.generate([list(range(1, 11))])
    assert len(short.generate([[1, 2, 3]], SamplingParams(max_tokens=50, temperature=0.0))[0].token_ids) == 7
    with pytest.raises(InvalidRequestError, match="json_schema does not compile"):
        json_llm.generate([[5], [6]], [GREEDY, SamplingParams(json_schema={"type": "object", "minProperties": "x"})])
    assert not json_llm.engine.has_unfinished() and not json_llm._trackers


def test_vllm_shapes_stop_token_ids_and_logprobs(llm: LLM) -> None:
    prompt = [21, 22, 23, 24, 25]
    full = llm.generate([prompt], GREEDY)[0]
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in full.outputs] == \
        [(0, full.text, full.token_ids, full.finish_reason)]
    i = _first_new_token(full.token_ids)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[full.token_ids[i]],
                                                ignore_eos=True))[0].outputs[0]
    # as vLLM: the stop token ends token_ids, and its text is left out
    assert out.token_ids == full.token_ids[:i + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(full.token_ids[:i])
    with pytest.raises(InvalidRequestError, match="above this artifact's max_logprobs"):
        llm.generate([prompt], SamplingParams(logprobs=99))
