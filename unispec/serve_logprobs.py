"""The `logprobs` of an OpenAI choice, from the engine's entries (runtime/sequence.py `TokenLogprobs`: per
generated token, the sampled token first, then the k most likely of the target's raw distribution).

    completions  {"tokens": [text], "token_logprobs": [float], "text_offset": [int],
                  "top_logprobs": [{text: float}]}           each dict: the k most likely and the sampled token
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
                                                             each list: the n most likely, by rank

A token shows as its decoded text, or `token_id:<id>` without a tokenizer (vLLM's spelling).
"""

from __future__ import annotations

from typing import Literal

from runtime.sequence import Logprob, TokenLogprobs

__all__ = ["choice_logprobs", "token_chars", "token_text"]


def choice_logprobs(kind: Literal["completion", "chat"], n: int | None, entries: list[TokenLogprobs] | None,
                    text_offset: int = 0) -> dict | None:
    """A choice's `logprobs` for the tokens of `entries`, n top entries per token (chat); the first token's
    text starts at `text_offset` of the choice's text (completions). None when the request asked for none
    (n None) or there are no entries (None)."""
    if n is None or entries is None:
        return None
    if kind == "chat":
        return {"content": [_chat_token(entry, n) for entry in entries]}
    tokens = [token_text(*_sampled(entry)) for entry in entries]
    offsets = [text_offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [_sampled(entry)[1].logprob for entry in entries],
            "top_logprobs": [{token_text(t, lp): lp.logprob for t, lp in entry.items()} for entry in entries],
            "text_offset": offsets}


def token_chars(entries: list[TokenLogprobs]) -> int:
    """Characters the sampled tokens of `entries` show as (a streamed choice's next text_offset)."""
    return sum(len(token_text(*_sampled(entry))) for entry in entries)


def token_text(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _sampled(entry: TokenLogprobs) -> tuple[int, Logprob]:
    return next(iter(entry.items()))


def _chat_token(entry: TokenLogprobs, n: int) -> dict:
    def item(token_id: int, logprob: Logprob) -> dict:
        text = token_text(token_id, logprob)
        return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}

    top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n)
    return {**item(*_sampled(entry)), "top_logprobs": [item(t, entry[t]) for _, t in top[:n]]}
