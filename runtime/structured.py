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

Compiling happens before a request joins the batch, on a worker thread, outside the LLM's lock: xgrammar
releases the GIL while it compiles (measured: a Python thread kept ticking every <= 53 ms through a 3 s
compile, with 1 or 8 xgrammar threads), so streams keep stepping meanwhile. What bounds it: SamplingParams
refuses constraints over MAX_CONSTRAINT_BYTES or (JSON schemas) MAX_SCHEMA_DEPTH, which keeps compiles
well under a second on the measured cases; a request waits at most COMPILE_TIMEOUT_S for its constraint,
then is refused in one line, and at most MAX_COMPILING constraints compile at once. A thread cannot be
stopped, so a compile that outlasts its request finishes in the background into the cache (the same
constraint sent again is then served at once). Compiled constraints are cached by their text (LRU).

xgrammar is imported only when a request asks for structured output.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from runtime import manifest as io
from runtime.errors import BackendUnavailableError, InvalidRequestError
from runtime.sampling_params import SamplingParams

__all__ = ["GrammarCompiler", "RequestGrammar", "check_structured_support", "token_allowed"]

# Compact JSON: xgrammar's default `any_whitespace` lets a model pad JSON with unbounded whitespace
# (a known way for structured generation to never finish); the separators carry no spaces either.
JSON_SEPARATORS = (",", ":")
COMPILE_TIMEOUT_S = 10.0     # the longest a request waits for its constraint to compile
MAX_COMPILING = 2            # constraints compiling at once (each on xgrammar's own thread pool)
CACHE_SIZE = 64              # compiled constraints kept, least recently used dropped first


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
    """Compiles requests' constraints against one tokenizer (built on first use), on worker threads, into a
    cache; thread-safe: callers need not hold the LLM's lock, and must not (see the module's note)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, tuple(stop_token_ids)
        self.timeout_s = timeout_s
        self._compiler: Any = None
        self._lock = threading.Lock()                  # the cache and the compiler built on first use
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._slots = threading.BoundedSemaphore(MAX_COMPILING)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._new_compiler()
            return self._compiler

    def _new_compiler(self) -> Any:
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
        # this class caches (bounded); xgrammar's own cache has no bound by default
        return xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, params: SamplingParams) -> Any:
        """The request's compiled grammar, cached or compiled on a worker thread; InvalidRequestError naming
        the field when it does not compile, or not within `timeout_s`."""
        kind, spec = params.structured
        try:
            return self._future(kind, spec).result(timeout=self.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(f"SamplingParams.{kind} did not compile within {self.timeout_s:g} s; simplify "
                                      f"the {kind.replace('_', ' ')} (fewer enum values, alternatives or nesting), "
                                      "or send it again later (it is still compiling)") from None
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc)) from None      # a cached error: a fresh one for this caller

    def _future(self, kind: str, spec: str) -> Future:
        """The cache's entry for a constraint; a new one starts compiling on a daemon thread (an exiting
        process does not wait for it)."""
        with self._lock:
            future = self._cache.get((kind, spec))
            if future is not None:
                self._cache.move_to_end((kind, spec))
                return future
            future = self._cache[kind, spec] = Future()
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        threading.Thread(target=self._compile_into, args=(future, kind, spec), name="unispec-grammar",
                         daemon=True).start()
        return future

    def _compile_into(self, future: Future, kind: str, spec: str) -> None:
        with self._slots:
            try:
                future.set_result(self._compile_now(kind, spec))
            except BaseException as exc:        # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def _compile_now(self, kind: str, spec: str) -> Any:
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
