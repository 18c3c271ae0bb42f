"""One request's state in the host loop, and what a finished request returns.

A request's tokens are `prompt + generated`; `cache_len` of them are committed to the KV pools. What a
step feeds for the request follows from those two numbers alone (DESIGN.md §3):

  nothing generated yet    prefill: the next chunk of the prompt; the step that feeds the last prompt
                           token generates (its next_token is the first output token)
  generated, 1 pending     decode: [last generated token] + the drafts of the previous step
  generated, >1 pending    recompute after a preemption: chunks of everything but the last token, the
                           token after each chunk as `chunk_next_tokens`; nothing is generated, and the
                           saved drafts are verified by the first decode step afterwards

So a preempted request continues exactly where it stopped: same tokens, same drafts, and its noise
stream advances only on steps that generate, never on prefill or recompute chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime import manifest as io
from runtime.detokenizer import IncrementalText
from runtime.errors import InvalidRequestError
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.structured import RequestGrammar

__all__ = ["FINISH_REASONS", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SequenceState",
           "TokenLogprobs", "acceptance_summary", "token_logprobs", "validate_prompt"]

FINISH_REASONS = ("stop", "length", "cancelled", "error")


def acceptance_summary(accepted: Sequence[int], k: int) -> tuple[float, tuple[float, ...]]:
    """(mean accepted length = tokens committed per decode step, share of steps that accepted draft j for
    j < k) of a list of per-step num_accepted; (1.0, zeros) without decode steps."""
    steps = np.asarray(accepted, dtype=np.int64)                                       # [decode steps]
    if not steps.size:
        return 1.0, (0.0,) * k
    return 1.0 + float(steps.mean()), tuple(float((steps > j).mean()) for j in range(k))


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target's raw distribution (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None              # 1-based rank in the distribution (1 = most likely)
    decoded_token: str | None = None     # the token's own text; None without a tokenizer


TokenLogprobs = dict[int, Logprob]       # token id -> Logprob: the sampled token first, then the top k by rank


def token_logprobs(token: int, logprob: float, rank: int, top: Sequence[float], top_ids: Sequence[int], k: int,
                   decode: Callable[[list[int]], str] | None) -> TokenLogprobs:
    """The entries of one generated token: itself (with its rank, which may be > k, as vLLM includes it),
    then the k most likely tokens (top / top_ids: the graph's N >= k, descending)."""
    def entry(token_id: int, value: float, rank: int) -> Logprob:
        return Logprob(value, rank, None if decode is None else decode([token_id]))

    entries = {token: entry(token, logprob, rank)}
    for i in range(k):
        if top_ids[i] not in entries:
            entries[top_ids[i]] = entry(top_ids[i], top[i], i + 1)
    return entries


@dataclass(frozen=True, kw_only=True)
class RequestMetrics:
    num_steps: int                               # steps the request took part in, prefill chunks included
    accepted_per_step: tuple[int, ...]           # num_accepted of each decode step
    acceptance_per_position: tuple[float, ...]   # [K] share of decode steps that accepted draft j
    mean_accepted_length: float                  # tokens committed per decode step: 1 + mean accepted
    num_generated: int
    num_preemptions: int                         # times the request lost its blocks and was recomputed
    time_to_first_token_s: float                 # submission to first token (nan when none came)
    elapsed_s: float                             # first admission to finish
    tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class CompletionOutput:
    """One completion of a request, as vLLM shapes it (`out.outputs[i]`)."""

    index: int                                   # 0 .. n-1
    text: str                                    # "" without a tokenizer
    token_ids: list[int]
    finish_reason: str                           # one of FINISH_REASONS
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids; None unless SamplingParams.logprobs
    cumulative_logprob: float | None = None      # the sum of the generated tokens' log-probabilities (same)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """A finished request. `outputs` holds its completions (n of them, vLLM's shape); the fields
    token_ids / text / finish_reason / metrics are the first completion's."""

    request_id: Hashable
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str                                    # "" without a tokenizer
    finish_reason: str                           # one of FINISH_REASONS
    metrics: RequestMetrics
    outputs: tuple[CompletionOutput, ...] = ()   # () when built: this output's own fields as completion 0
    logprobs: list[TokenLogprobs] | None = None  # the first completion's (see CompletionOutput)
    cumulative_logprob: float | None = None

    def __post_init__(self) -> None:
        if not self.outputs:
            own = CompletionOutput(index=0, text=self.text, token_ids=self.token_ids,
                                   finish_reason=self.finish_reason, metrics=self.metrics, logprobs=self.logprobs,
                                   cumulative_logprob=self.cumulative_logprob)
            object.__setattr__(self, "outputs", (own,))

    @property
    def finished(self) -> bool:
        return True

    @classmethod
    def of_completions(cls, parts: Sequence[RequestOutput]) -> RequestOutput:
        """One request's output from the outputs of its n completions (each run as its own request)."""
        first = parts[0]
        completions = tuple(CompletionOutput(index=i, text=p.text, token_ids=p.token_ids,
                                             finish_reason=p.finish_reason, metrics=p.metrics, logprobs=p.logprobs,
                                             cumulative_logprob=p.cumulative_logprob)
                            for i, p in enumerate(parts))
        return cls(request_id=first.request_id, prompt_token_ids=first.prompt_token_ids, token_ids=first.token_ids,
                   text=first.text, finish_reason=first.finish_reason, metrics=first.metrics, outputs=completions,
                   logprobs=first.logprobs, cumulative_logprob=first.cumulative_logprob)

    def summary(self) -> str:
        """One line: tokens, speed, speculative acceptance, why it ended."""
        m = self.metrics
        parts = [f"{m.num_generated} tokens in {m.elapsed_s:.2f} s ({m.tokens_per_s:.1f} tokens/s)",
                 f"{m.num_steps} steps", f"mean accepted length {m.mean_accepted_length:.2f}"]
        if m.acceptance_per_position:
            parts.append("acceptance per position " + " ".join(f"{a:.2f}" for a in m.acceptance_per_position))
        if m.num_preemptions:
            parts.append(f"{m.num_preemptions} preemptions")
        return " · ".join([*parts, f"finish: {self.finish_reason}"])


def validate_prompt(prompt: Sequence[int], manifest: io.Manifest, where: str = "prompt",
                    max_model_len: int | None = None) -> None:
    """One-line InvalidRequestError for an empty, out-of-vocabulary or too long prompt."""
    limit = manifest.max_model_len if max_model_len is None else max_model_len
    if len(prompt) == 0:
        raise InvalidRequestError(f"{where} is empty; give at least one token")
    for i, token in enumerate(prompt):
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < manifest.vocab_size:
            raise InvalidRequestError(f"{where} token {i} is {token!r}; token ids must be ints in "
                                      f"[0, {manifest.vocab_size}) for this artifact")
    if len(prompt) >= limit:
        raise InvalidRequestError(f"{where} has {len(prompt)} tokens; this artifact's max_model_len is "
                                  f"{limit}, so prompts must be shorter than that")


@dataclass(eq=False)
class SequenceState:
    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    max_new: int                                 # new tokens at most (max_tokens, capped by max_model_len)
    noise: RequestNoise
    stop_ids: frozenset[int] = frozenset()       # token ids that end the request
    think_ids: tuple[int, int] | None = None     # (start, end) when relaxed thinking is on
    grammar: RequestGrammar | None = None
    stream: bool = False                         # the listener gets the text as it becomes final
    text: IncrementalText | None = None          # with stop strings or a stream (and a tokenizer)
    generated: list[int] = field(default_factory=list)
    # one entry per generated token when SamplingParams.logprobs is set (the engine fills it), else None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    cache_len: int = 0                           # tokens committed to the pools
    draft_len: int = 0                           # of those, the ones with draft KV (adaptive speculation)
    drafts: list[int] | None = None              # [K] drafts to verify next decode step
    draft_probs: np.ndarray | None = None        # [K, V] the q they were sampled from (artifacts with draft_probs)
    thinking: bool = False                       # between think start and end (only with think_ids)
    accepted: list[int] = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    stop_at: int | None = None                   # text length where a stop string begins
    stopped_by_token: bool = False               # the last token is a stop token (not part of the text)

    def __post_init__(self) -> None:
        if self.think_ids is not None:
            for token in self.prompt:
                self._track_thinking(token)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def pending(self) -> int:
        """Tokens not committed to the pools yet."""
        return self.num_tokens - self.cache_len

    @property
    def is_decode(self) -> bool:
        generated = self.generated       # (pending == 1, spelled out: the host loop asks this of every row often)
        return bool(generated) and len(self.prompt) + len(generated) - self.cache_len == 1

    @property
    def chunk_limit(self) -> int:
        """The most tokens a prefill / recompute chunk may take now (the last generated token is decoded)."""
        return self.pending - 1 if self.generated else self.pending

    def generates(self, n: int) -> bool:
        """Whether a step that feeds `n` tokens of this request produces output tokens."""
        return self.is_decode or (not self.generated and n == self.pending)

    def token_at(self, position: int) -> int:
        p = len(self.prompt)
        return self.prompt[position] if position < p else self.generated[position - p]

    def tokens(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt)
        head = self.prompt[start:min(stop, p)] if start < p else []
        tail = self.generated[max(start - p, 0):stop - p] if stop > p else []
        return head + tail

    def preempt(self) -> None:
        """Forget the pools' contents; the request recomputes them when it runs again."""
        self.cache_len = self.draft_len = 0
        self.num_preemptions += 1

    def add_token(self, token: int) -> None:
        self.generated.append(token)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.think_ids is not None:
            self._track_thinking(token)

    def _track_thinking(self, token: int) -> None:
        start, end = self.think_ids
        if token == start:
            self.thinking = True
        elif token == end:
            self.thinking = False

    def metrics(self, k: int) -> RequestMetrics:
        mean_length, per_position = acceptance_summary(self.accepted, k)
        now = time.perf_counter()
        elapsed = now - (self.admitted_at if self.admitted_at is not None else now)
        first = self.first_token_at - self.submitted_at if self.first_token_at is not None else float("nan")
        return RequestMetrics(
            num_steps=self.num_steps, accepted_per_step=tuple(self.accepted), acceptance_per_position=per_position,
            mean_accepted_length=mean_length,
            num_generated=len(self.generated), num_preemptions=self.num_preemptions,
            time_to_first_token_s=first, elapsed_s=elapsed,
            tokens_per_s=len(self.generated) / elapsed if elapsed > 0 else 0.0)
