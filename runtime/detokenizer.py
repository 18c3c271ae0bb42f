"""A request's text as its tokens arrive: each token decodes a short window, never the whole output.

Stop strings need the text after every token, and a stream needs the part of it that can no longer
change. Decoding the whole output each time costs O(n) per token; `IncrementalText` decodes a window of
the last few tokens instead, as vLLM's incremental detokenizer does:

    ids      ... | prefix ........ read | new tokens
    window = decode(ids[prefix:])        the prefix tokens give the new ones their context (spaces, merges)
    head   = decode(ids[prefix:read])    kept from the last time the window moved
    new    = window[len(head):]          text of the new tokens; once it ends in a whole character (no
                                         trailing U+FFFD: half a UTF-8 character) it joins the stable text
                                         and the window moves on: prefix <- read, read <- len(ids)

The text is `stable + new`, what decode(ids) gives. A stop string found in it was absent from every
earlier text, so each check searches only from len(stable at the last check) - len(longest stop) + 1.
A stream is handed the text without a trailing partial character and without a tail that may still grow
into a stop string (hold-back), so it never shows text that the final output cuts off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Detokenize", "IncrementalText"]

Detokenize = Callable[[Sequence[int]], str]
REPLACEMENT = "\ufffd"                    # what a decoder shows for an incomplete UTF-8 sequence


class IncrementalText:
    """The growing text of one request's generated tokens, with its stop strings."""

    def __init__(self, detokenize: Detokenize, stop_strings: Sequence[str] = ()) -> None:
        self._decode = detokenize
        self.stop_strings = tuple(stop_strings)
        self._longest = max(map(len, self.stop_strings), default=0)
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self._head = ""                   # decode(ids[prefix:read])
        self._pieces: list[str] = []      # the stable text, one piece per window move
        self._stable_len = 0
        self._new = ""                    # text of ids[read:]; may end in REPLACEMENT
        self._searched = 0                # stable length at the last stop-string search
        self._shown = 0                   # text handed out by take_visible
        self.stop_at: int | None = None   # where the first stop string begins, once one appeared

    def __len__(self) -> int:
        return self._stable_len + len(self._new)

    @property
    def text(self) -> str:
        return self._text_from(0)

    def add(self, token: int) -> bool:
        """Append one token; True once a stop string has appeared (it begins at `stop_at`)."""
        self._ids.append(token)
        window = self._decode(self._ids[self._prefix:])
        new = window[len(self._head):]
        if new and not window.endswith(REPLACEMENT):
            self._pieces.append(new)
            self._stable_len += len(new)
            self._prefix, self._read = self._read, len(self._ids)
            self._head = self._decode(self._ids[self._prefix:])
            new = ""
        self._new = new
        return self._find_stop()

    def take_visible(self) -> str:
        """The text that can no longer change and was not handed out yet ("" when there is none)."""
        end = self._stable_len + len(self._new.rstrip(REPLACEMENT))
        reach = sum(len(s) - 1 for s in self.stop_strings)      # the most the hold-back can take
        start = max(0, min(self._shown, end - reach))
        text = self._text_from(start)[:end - start]
        for stop in self.stop_strings:
            text = text[:len(text) - _held(text, stop)]          # might still become this stop string
        end = start + len(text)
        if end <= self._shown:
            return ""
        visible, self._shown = text[self._shown - start:], end
        return visible

    def _find_stop(self) -> bool:
        if self.stop_at is None and self.stop_strings:
            start = max(0, self._searched - self._longest + 1)
            region = self._text_from(start)
            hits = [i for i in (region.find(s) for s in self.stop_strings) if i >= 0]
            self._searched = self._stable_len
            if hits:
                self.stop_at = start + min(hits)
        return self.stop_at is not None

    def _text_from(self, start: int) -> str:
        """text[start:], joining only the pieces it reaches into."""
        parts, begin = [self._new], self._stable_len
        for piece in reversed(self._pieces):
            if begin <= start:
                break
            parts.append(piece)
            begin -= len(piece)
        return "".join(reversed(parts))[start - begin:]


def _held(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with (0 if none)."""
    if not text:
        return 0
    last = text[-1]
    i = stop.rfind(last, 0, len(stop) - 1)            # candidates: prefixes stop[:i + 1] ending in `last`
    while i >= 0:
        if text.endswith(stop[:i + 1]):
            return i + 1
        i = stop.rfind(last, 0, i)
    return 0
