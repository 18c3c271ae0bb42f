"""runtime/detokenizer.py: the incremental text equals a full decode after every token (byte-level BPE with
characters split across tokens and invalid UTF-8, word-level with skipped special tokens); stop strings are
found at the same token and position as a full-text search, also when split across tokens; a stream's
hold-back never shows text the final output cuts off; through the LLM, a stop string split across two
steps stops the request where a full decode would, and the stream shows exactly the final text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from runtime.detokenizer import IncrementalText
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX, write_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, VOCAB)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def word_level() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 40)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


def decoder(tokenizer: Tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def sequences(tokenizer: Tokenizer, rng: random.Random) -> list[list[int]]:
    """Random ids (invalid UTF-8 included) and encoded text with characters of 2-4 UTF-8 bytes."""
    texts = ["héllo wörld → ∑ 🙂🙂 done", "naïve café 中文字 the quick brown fox", '{"a":1,"b":true} ✓']
    encoded = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    size = tokenizer.get_vocab_size()
    return encoded + [[rng.randrange(size) for _ in range(rng.randrange(1, 60))] for _ in range(40)]


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_the_text_equals_a_full_decode_after_every_token(kind: str, byte_level: Tokenizer) -> None:
    tokenizer = byte_level if kind == "byte-level" else word_level()
    decode = decoder(tokenizer)
    for ids in sequences(tokenizer, random.Random(0)):
        text = IncrementalText(decode)
        for n, token in enumerate(ids, 1):
            assert not text.add(token)
            assert text.text == decode(ids[:n]) and len(text) == len(text.text)


def naive_stop(decode, ids: list[int], stops: list[str]) -> tuple[int, int] | None:
    """(token index, text position) where a full decode after every token first holds a stop string."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return n - 1, min(hits)
    return None


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_stop_strings_are_found_where_a_full_search_finds_them(kind: str, byte_level: Tokenizer) -> None:
    tokenizer = byte_level if kind == "byte-level" else word_level()
    decode, rng = decoder(tokenizer), random.Random(1)
    checked = 0
    for ids in sequences(tokenizer, rng):
        full = decode(ids)
        if len(full) < 4:
            continue
        for _ in range(4):
            start = rng.randrange(len(full) - 2)
            stops = [full[start:start + rng.randrange(2, 7)], "never in the text ⌘"]
            text = IncrementalText(decode, stops)
            found = next((i for i, token in enumerate(ids) if text.add(token)), None)
            want = naive_stop(decode, ids, stops)
            assert (None if found is None else (found, text.stop_at)) == want
            checked += want is not None
    assert checked > 50


def chars(pieces: list[str]):
    """A detokenizer over a made-up vocabulary: token i is pieces[i]."""
    return lambda ids: "".join(pieces[i] for i in ids)


def test_a_stop_string_split_across_tokens() -> None:
    text = IncrementalText(chars(["he", "ll", "o wo", "rld", "!"]), ["lo w", "xyz"])
    assert [text.add(t) for t in (0, 1)] == [False, False]
    assert text.add(2) and text.stop_at == 3                    # "hello wo": "lo w" spans tokens 1 and 2
    assert text.text[:text.stop_at] == "hel"


def test_hold_back_keeps_a_possible_stop_string_out_of_a_stream() -> None:
    text = IncrementalText(chars(["ab", "c", "X", "cd", "e"]), ["cde", "Xc"])
    assert not text.add(0) and text.take_visible() == "ab"
    assert not text.add(1) and text.take_visible() == ""        # "c" may start "cde"
    assert not text.add(2) and text.take_visible() == "c"       # "cX": "c" cannot be "cde"; "X" may start "Xc"
    assert text.add(3) and text.stop_at == 3                    # "abcXcd": "Xc" found
    assert text.take_visible() == ""                            # the stop string never reaches the stream


def test_half_characters_are_held_back_until_whole() -> None:
    pieces = ["a", "\ufffd", "é"]
    # token 1 is the first byte of "é": alone it decodes to U+FFFD, with token 2 to "é"
    decode = lambda ids: "".join(pieces[i] for i in ids).replace("\ufffdé", "é")  # noqa: E731
    text = IncrementalText(decode)
    text.add(0)
    text.add(1)
    assert text.text == "a\ufffd" and text.take_visible() == "a"
    text.add(2)
    assert text.text == "aé" and text.take_visible() == "é"


# --- through the LLM: a stop string split across two steps --------------------------------------------------

@pytest.fixture(scope="module")
def json_llm(tiny_artifact) -> LLM:
    return LLM(tiny_artifact("llama3-eagle3" + JSON_SUFFIX).path, num_blocks=96)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens_per_step(llm: LLM, prompt: str) -> list[list[int]]:
    """The tokens each step committed for a greedy request."""
    steps, listener = [], llm.engine.listener

    def record(request_id, token_ids, text, output):
        if token_ids:
            steps.append(list(token_ids))
        listener(request_id, token_ids, text, output)

    llm.engine.listener = record
    try:
        llm.generate([prompt], GREEDY)
    finally:
        llm.engine.listener = listener
    return steps


def test_a_stop_string_split_across_steps_stops_the_stream_where_a_full_decode_would(json_llm: LLM) -> None:
    prompt = "the quick"
    steps = tokens_per_step(json_llm, prompt)
    decode = json_llm.tokenizer.decode
    ends = [sum(map(len, steps[:i + 1])) for i in range(len(steps) - 1)]      # tokens before each step boundary
    generated = [t for step in steps for t in step]
    for end in ends:
        before, after = decode(generated[:end]), decode(generated[:end + 1])
        stop = after[len(before) - 2:len(before) + 1]                         # 2 chars of one step, 1 of the next
        if len(before) >= 2 and after.startswith(before) and len(after) > len(before) \
                and after.find(stop) == len(before) - 2:
            break
    else:
        pytest.fail(f"no step boundary to split a stop string across in {steps}")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop)
    stream = json_llm.stream(prompt, params)
    deltas = list(stream)
    out = stream.output
    assert out.finish_reason == "stop" and out.token_ids == generated[:end + 1]
    assert out.text == before[:-2] == "".join(deltas)                       # held back, then cut
    assert json_llm.generate([prompt], params)[0].text == out.text
    assert json_llm.engine.blocks.num_free == json_llm.num_blocks and not json_llm._trackers
