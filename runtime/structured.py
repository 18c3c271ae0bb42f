"""Structured output through xgrammar: per-request grammar matchers and the step's `token_bitmask` rows.

The step graph masks the target logits of every verified position with `token_bitmask [B, K+1, W]`
(W = ceil(V/32), bit v of word v // 32 allows token v). Row i must hold the grammar state after the
row's first i drafts, row K the bonus position (DESIGN.md §3). The host fills them by advancing the
request's matcher along the drafts and rolling it back (reference/max_specdecode.md §5):

    row 0  <- state after the committed tokens
    for i in 0..K-1:  stop if d_i is not allowed by row i (or the grammar ended);
                      accept d_i, row i+1 <- the new state
    rollback every draft accepted here                     (rows never filled stay -1: all allowed)

Rows left at -1 are never used: a draft that row i forbids gets probability 0 from the masked target,
so nothing past it is accepted. The matcher itself advances only by committed tokens (`accept`), so a
finished request's output always matches the grammar; a grammar that ends (a stop token, or its last
character when the tokenizer knows no stop token) finishes the request.

xgrammar is imported only when a request asks for structured output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime import manifest as io
from runtime.errors import BackendUnavailableError, InvalidRequestError
from runtime.sampling_params import SamplingParams

__all__ = ["GrammarCompiler", "RequestGrammar", "check_structured_support", "token_allowed"]

# Compact JSON: xgrammar's default `any_whitespace` lets a model pad JSON with unbounded whitespace
# (a known way for structured generation to never finish); the separators carry no spaces either.
JSON_SEPARATORS = (",", ":")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise BackendUnavailableError("structured output needs xgrammar; pip install xgrammar") from None
    return xgrammar


def check_structured_support(manifest: io.Manifest, has_tokenizer: bool, params: SamplingParams) -> None:
    """One-line InvalidRequestError when this artifact cannot serve the request's constraint."""
    if params.structured is None:
        return
    kind = params.structured[0]
    if not manifest.structured_output or io.TOKEN_BITMASK not in {t.name for t in manifest.inputs}:
        raise InvalidRequestError(f"SamplingParams.{kind} needs an artifact exported with structured output; "
                                  f"this {manifest.method} artifact has no {io.TOKEN_BITMASK} input: re-export "
                                  "it with `unispec export --structured-output` (export_model(..., "
                                  "structured_output=True))")
    if not has_tokenizer:
        raise InvalidRequestError(f"SamplingParams.{kind} needs the artifact's tokenizer.json to map the grammar "
                                  "onto tokens; this artifact has none, re-export from a checkpoint that has it")


def token_allowed(row: np.ndarray, token: int) -> bool:
    """Whether bitmask row `row` [W] int32 allows `token`."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


class GrammarCompiler:
    """Compiles requests' constraints against one tokenizer (built on first use; xgrammar caches grammars)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, tuple(stop_token_ids)
        self._compiler: Any = None

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            xgr = _xgrammar()
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            encoded = [""] * self.vocab_size
            for token, index in vocab.items():
                if index < self.vocab_size:
                    encoded[index] = token
            # xgrammar.TokenizerInfo.from_huggingface wants a transformers tokenizer, which the runtime does
            # not depend on; it reads the vocabulary type from the same `tokenizers` JSON as this call does.
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(self.tokenizer.to_str())
            info = xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=self.vocab_size,
                                     stop_token_ids=list(self.stop_token_ids) or None,
                                     add_prefix_space=metadata["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, params: SamplingParams) -> Any:
        """The request's compiled grammar; InvalidRequestError naming the field when it does not compile."""
        kind, spec = params.structured
        compiler = self._xgrammar_compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=False, separators=JSON_SEPARATORS)
            if kind == "regex":
                return compiler.compile_regex(spec)
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise InvalidRequestError(f"SamplingParams.{kind} does not compile: {reason}; fix the "
                                      f"{kind.replace('_', ' ')}") from None

    def matcher(self, params: SamplingParams) -> RequestGrammar:
        """A fresh matcher of the request's constraint (compiled here); InvalidRequestError when the
        constraint does not compile or allows no output at all."""
        grammar = RequestGrammar(_xgrammar().GrammarMatcher(
            self.compile(params), terminate_without_stop_token=not self.stop_token_ids))
        if not grammar.can_start(self.vocab_size):
            kind = params.structured[0]
            raise InvalidRequestError(f"SamplingParams.{kind} matches no output: it allows no first token (a rule "
                                      "such as `root ::= root` never produces text); fix the "
                                      f"{kind.replace('_', ' ')}")
        return grammar


class RequestGrammar:
    """One request's grammar state: advanced by committed tokens only."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def can_start(self, vocab_size: int) -> bool:
        """Whether any token is allowed now (or the grammar has already ended)."""
        row = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)
        self._matcher.fill_next_token_bitmask(row, 0)
        return bool(row.any()) or self.terminated

    def accept(self, token: int) -> bool:
        """Advance by one committed token; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token)))

    def fill_rows(self, rows: np.ndarray, drafts: Sequence[int] | None) -> None:
        """rows [K+1, W] int32 (preset to -1): row i = state after drafts[:i]; the matcher ends unchanged."""
        matcher = self._matcher
        matcher.fill_next_token_bitmask(rows, 0)
        advanced = 0
        for i in range(0 if drafts is None else len(drafts)):
            draft = int(drafts[i])
            # checking the row first also keeps xgrammar from logging a warning for every rejected draft
            if draft < 0 or draft >= rows.shape[-1] * 32 or not token_allowed(rows[i], draft):
                break
            if not matcher.accept_token(draft):
                break
            advanced += 1
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(rows, i + 1)
        if advanced:
            matcher.rollback(advanced)
