"""The host loop: fills one step's inputs from the scheduled rows, runs it, commits KV, collects tokens.

It drives an artifact's unified step as the torch reference loop (tests/reference_loop.py) does, with numpy,
a BlockManager, a Scheduler (continuous batching, chunked prefill, preemption) and persistent input
buffers (DESIGN.md §3, §7). Per step: the scheduler picks the rows and their token counts,
runtime/step_feeds.py writes their inputs in place (what each kind of row feeds, noise, bitmasks), the
backend runs the graph, the commit pairs of the rule go to `backend.commit`, and each row that generates
takes its accepted drafts, then next_token.

Adaptive speculation (runtime/speculation.py): a step runs the speculative graph or the artifact's
target-only graph (K = 0, the draft pool left alone). A row remembers how far its draft KV reaches
(`draft_len`); before a speculative step, a row that decoded target-only since is rolled back to it and
recomputed, like a preempted one. `speculation="auto"` chooses per step from measured step times and
acceptance; "always" / "never" force one graph. Under "auto" a step with a seeded sampled row speculates,
so that request's tokens do not depend on the batch or on timing (see runtime/speculation.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

from runtime import manifest as io
from runtime.backend import Backend
from runtime.blocks import BlockManager
from runtime.detokenizer import Detokenize, IncrementalText
from runtime.errors import InvalidRequestError
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Plan, Scheduler
from runtime.sequence import (
    RequestMetrics,
    RequestOutput,
    SequenceState,
    TokenLogprobs,
    token_logprobs,
    validate_prompt,
)
from runtime.speculation import SPECULATIVE, TARGET_ONLY, SpeculationPolicy
from runtime.speculation_calibration import calibrate
from runtime.speculation_record import CostRecord, RecordFile, RecordSaver
from runtime.step_feeds import StepFeeds
from runtime.structured import GrammarCompiler, RequestGrammar, check_structured_support

__all__ = ["CheckedRequest", "Engine", "Listener", "RequestMetrics", "RequestOutput", "StepTimings",
           "validate_prompt"]

# (request id, tokens committed this step, text a stream may show now, the output when the request
# finished) after every change; the text is "" unless the request was added with stream=True
Listener = Callable[[Hashable, list[int], str, RequestOutput | None], None]


@dataclass(frozen=True)
class CheckedRequest:
    """A request that `Engine.check_request` accepted: validated and its grammar compiled, once."""

    prompt: list[int]
    params: SamplingParams
    max_new: int                             # new tokens at most (max_tokens, capped by max_model_len)
    grammar: RequestGrammar | None           # a fresh matcher of its compiled constraint


@dataclass
class StepTimings:
    """Wall and CPU time of the steps run since the last reset, split where the step graph runs.

    graph_s is the backend's `run` call (the step graph); host_s is the rest of `Engine.step`: scheduling,
    filling the feeds, committing the KV deltas and advancing the requests. The *_cpu_s twins are process
    CPU time over the same spans: on a shared machine wall time also counts other processes' turns, CPU
    time does not (with 1 intra-op thread it is the step's own work). target_only_* count the steps that
    ran the target-only graph (adaptive speculation), and their whole wall time, within those totals.
    """

    steps: int = 0
    graph_s: float = 0.0
    host_s: float = 0.0
    graph_cpu_s: float = 0.0
    host_cpu_s: float = 0.0
    target_only_steps: int = 0
    target_only_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.graph_s + self.host_s


class Engine:
    """Continuous batching over one backend; `add_request` / `abort` between `step` calls."""

    def __init__(self, backend: Backend, *, eos_token_ids: Sequence[int] = (), detokenize: Detokenize | None = None,
                 prefill_chunk: int | None = None, max_model_len: int | None = None,
                 grammars: GrammarCompiler | None = None, listener: Listener | None = None,
                 speculation: str = "auto", record: RecordFile | None = None) -> None:
        """`record`: where `speculation="auto"` starts from what earlier engines on this artifact learned and
        leaves what this one learns, when it runs out of requests and when it is let go (RecordSaver)."""
        m = self.manifest = backend.manifest
        self.backend, self.k = backend, m.num_speculative_tokens
        self.eos_token_ids, self.detokenize = frozenset(eos_token_ids), detokenize
        self.grammars, self.listener = grammars, listener
        self.max_model_len = bounded("max_model_len", max_model_len, m.max_model_len, lower=2)
        chunk = bounded("prefill_chunk", prefill_chunk, m.max_tokens_per_step, lower=1)
        self.blocks = BlockManager(backend.num_blocks, m.block_size)
        self.scheduler = Scheduler(self.blocks, k=self.k, max_batch_size=m.max_batch_size,
                                   max_tokens_per_step=m.max_tokens_per_step, prefill_chunk=chunk)
        specs = backend.input_specs()
        self.feeds = StepFeeds(m, specs, self.blocks)
        self.buffers = self.feeds.buffers
        self._input_names = frozenset(s.name for s in specs)
        has_target_only = backend.has_target_only
        known = record.load() if record is not None else None
        self.policy = SpeculationPolicy(speculation, k=self.k, has_target_only=has_target_only, known=known)
        self._record: RecordSaver | None = None      # set below, once the engine is whole
        only = frozenset(s.name for s in backend.target_only_input_specs()) if has_target_only else frozenset()
        # a `none` artifact (K = 0) runs its one graph for "target-only" steps
        self._names = {SPECULATIVE: self._input_names, TARGET_ONLY: only if self.k else self._input_names}
        # pools the speculative graph writes and the target-only one does not: a gap there needs a recompute
        self._gapped = has_target_only and any(p.name not in only for p in m.pools)
        self._ids = count()
        self.num_steps = 0
        self.timings = StepTimings()
        if record is not None and self.policy.adaptive:
            known = known or CostRecord()
            calibrated = calibrate(self, known)                        # a first use times both graphs
            if calibrated is not known:
                self.policy = SpeculationPolicy(speculation, k=self.k, has_target_only=True, known=calibrated)
                record.save(calibrated)
            self._record = RecordSaver(record, self.policy.learned, calibrated)
            weakref.finalize(self, self._record.close)

    @property
    def waiting(self) -> Sequence[SequenceState]:
        return self.scheduler.waiting

    @property
    def running(self) -> Sequence[SequenceState]:
        return self.scheduler.running

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- requests -----------------------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], params: SamplingParams, where: str = "prompt") -> CheckedRequest:
        """The request validated and its grammar compiled; a one-line InvalidRequestError if it cannot run here.
        It reads only settings fixed at construction, so callers may run it without the LLM's lock (and do:
        compiling may take up to the grammar compiler's timeout)."""
        validate_prompt(prompt, self.manifest, where, max_model_len=self.max_model_len)
        max_new = min(params.max_tokens, self.max_model_len - len(prompt))
        worst = self.manifest.blocks_per_row(len(prompt) + max_new)
        if worst > self.blocks.num_blocks:
            raise InvalidRequestError(f"a {len(prompt)}-token prompt with max_tokens={max_new} needs {worst} KV "
                                      f"blocks, the pool has {self.blocks.num_blocks}; give the LLM more "
                                      "num_blocks / kv_memory_bytes or lower max_tokens")
        check_structured_support(self.manifest, self.grammars is not None, params)
        # a bad schema / regex / grammar fails here, before any step
        grammar = self.grammars.matcher(params) if params.structured else None
        if params.relaxed_thinking:
            self._check_thinking_support()
        if params.logprobs is not None:
            self._check_logprobs_support(params.logprobs)
        return CheckedRequest([int(t) for t in prompt], params, max_new, grammar)

    def _check_thinking_support(self) -> None:
        tok = self.manifest.tokenizer
        if io.IN_THINKING_PHASE not in self._input_names:
            raise InvalidRequestError(f"SamplingParams.relaxed_thinking: this {self.manifest.method} artifact has "
                                      f"no {io.IN_THINKING_PHASE} input (no relaxed acceptance); leave it False")
        if tok.think_start_id is None or tok.think_end_id is None:
            raise InvalidRequestError("SamplingParams.relaxed_thinking needs the tokenizer's <think> and </think> "
                                      "tokens, which this artifact's manifest does not name; leave it False")

    def _check_logprobs_support(self, k: int) -> None:
        most = self.manifest.max_logprobs
        if not most:
            raise InvalidRequestError(f"SamplingParams.logprobs={k}: this artifact's graphs output no "
                                      "log-probabilities (exported with --max-logprobs 0, or before unispec had "
                                      "them); re-export it with `unispec export --max-logprobs N`, or leave it None")
        if k > most:
            raise InvalidRequestError(f"SamplingParams.logprobs={k} is above this artifact's max_logprobs of {most}; "
                                      f"ask for at most {most}, or re-export with a larger `unispec export "
                                      f"--max-logprobs` (at most {io.MAX_LOGPROBS})")

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None, *, stream: bool = False) -> Hashable:
        """Check and queue a request; `stream=True` also hands the listener its text as it becomes final."""
        return self.add_checked(self.check_request(prompt, params or SamplingParams()), request_id, stream=stream)

    def add_checked(self, request: CheckedRequest, request_id: Hashable | None = None, *,
                    stream: bool = False) -> Hashable:
        """Queue a request that `check_request` accepted (so it is not validated again)."""
        request_id = next(self._ids) if request_id is None else request_id
        if self.scheduler.find(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; give each request its own")
        params, tok = request.params, self.manifest.tokenizer
        wants_text = self.detokenize is not None and (stream or bool(params.stop_strings))
        seq = SequenceState(
            request_id, request.prompt, params, request.max_new, RequestNoise(params.seed),
            stop_ids=params.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids),
            think_ids=(tok.think_start_id, tok.think_end_id) if params.relaxed_thinking else None,
            grammar=request.grammar, stream=stream,
            text=IncrementalText(self.detokenize, params.stop_strings) if wants_text else None,
            logprobs=None if params.logprobs is None else [])
        self.scheduler.add(seq)
        return request_id

    def logprobs_of(self, request_id: Hashable) -> list[TokenLogprobs] | None:
        """The request's log-probability entries, one per generated token, as the engine appends them (the
        list itself: an entry is appended before its token reaches the listener); None when not collected."""
        seq = self.scheduler.find(request_id)
        return None if seq is None else seq.logprobs

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        """Cancel a request wherever it is; its blocks go back to the pool. None if it is not here."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        seq.finish_reason = "cancelled"
        return self._finish(seq, [])

    # --- one step -----------------------------------------------------------------------------------------

    def reset_timings(self) -> StepTimings:
        """Start `timings` afresh; returns the ones accumulated until now."""
        done, self.timings = self.timings, StepTimings()
        return done

    def step(self) -> list[RequestOutput]:
        """Run one step over the scheduled rows; returns the requests that finished in it."""
        started, started_cpu = time.perf_counter(), time.process_time()
        if not self.scheduler.has_unfinished():
            return []
        kind = self.policy.choose(self._next_rows())
        if kind == SPECULATIVE and self._gapped:
            self._resume_drafting()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        k = self.k if kind == SPECULATIVE else 0
        all_decode = all(seq.is_decode for seq in plan)
        # A step that fails leaves every request as it was (blocks taken for it stay with their rows) and
        # can simply be retried; only the noise drawn for it must be put back.
        noise = [(seq.noise, seq.noise.checkpoint()) for seq, n in plan.items() if seq.generates(n)]
        # (A half-done commit only wrote positions at or past each row's cache length, which nothing reads.)
        try:
            feeds = self.feeds.build(plan, k, self._names[kind])
            graph_started, graph_started_cpu = time.perf_counter(), time.process_time()
            run = self.backend.run if kind == SPECULATIVE or not self.k else self.backend.run_target_only
            outputs = run(feeds)
            graph_s, graph_cpu_s = time.perf_counter() - graph_started, time.process_time() - graph_started_cpu
            self.backend.commit(outputs, *self.feeds.commit_pairs(feeds, outputs[io.NUM_ACCEPTED], k))
        except BaseException:
            for stream, checkpoint in noise:
                stream.rewind(checkpoint)
            raise
        self.num_steps += 1
        self.on_step_outputs(plan, outputs)
        finished, verified = self._advance(plan, outputs, k)
        step_s = time.perf_counter() - started
        self.policy.record(kind, list(plan), step_s, all_decode, verified)
        t = self.timings
        t.steps, t.graph_s, t.graph_cpu_s = t.steps + 1, t.graph_s + graph_s, t.graph_cpu_s + graph_cpu_s
        t.host_s += step_s - graph_s
        t.host_cpu_s += time.process_time() - started_cpu - graph_cpu_s
        if kind == TARGET_ONLY:
            t.target_only_steps, t.target_only_s = t.target_only_steps + 1, t.target_only_s + step_s
        if finished and self._record is not None and not self.scheduler.has_unfinished():
            self._record.idle()                               # the next engine starts from what it learned
        return finished

    def _next_rows(self) -> list[SequenceState]:
        """The rows the next step will (about) hold: the running ones and those the scheduler may admit."""
        running = list(self.scheduler.running)
        return running + list(self.scheduler.waiting)[:max(0, self.manifest.max_batch_size - len(running))]

    def _resume_drafting(self) -> None:
        """Rows that decoded target-only lack draft KV past `draft_len`: recompute from there (their
        drafts, if any, were proposed before the gap and are dropped)."""
        for seq in self.scheduler.running:
            if seq.draft_len < seq.cache_len:
                seq.cache_len, seq.drafts, seq.draft_probs = seq.draft_len, None, None

    def on_step_outputs(self, plan: Plan, outputs: dict[str, np.ndarray]) -> None:
        """Every step's graph outputs, before the engine reads them (valid until the next run): a hook for
        subclasses (runtime/evaluation.py keeps each row's logits). Does nothing here."""

    def _advance(self, plan: Plan, outputs: dict[str, np.ndarray],
                 k: int) -> tuple[list[RequestOutput], list[tuple[SequenceState, int]]]:
        """(the requests that finished, (row, accepted drafts) of every row that verified drafts)."""
        accepted = outputs[io.NUM_ACCEPTED].tolist()
        next_tokens = outputs[io.NEXT_TOKENS].tolist()
        # copies for all rows at once (the outputs are overwritten by the next run): lists, and views of one array
        next_drafts = outputs[io.NEXT_DRAFT_TOKENS].tolist()                             # [B][K]
        next_probs = outputs.get(io.NEXT_DRAFT_PROBS)                                    # [B, K, V] or None
        next_probs = None if next_probs is None else next_probs.copy()
        finished, verified = [], []
        for i, (seq, n) in enumerate(plan.items()):
            seq.num_steps += 1
            generates, was_decode = seq.generates(n), seq.is_decode
            seq.cache_len += n + accepted[i]
            if k:
                seq.draft_len = seq.cache_len            # the speculative graph wrote the draft KV too
            if not generates:
                continue                         # a prefill / recompute chunk: its next token is ignored
            new = [next_tokens[i]]
            if was_decode and k and seq.drafts is not None:          # drafts were verified
                seq.accepted.append(accepted[i])
                verified.append((seq, accepted[i]))
                new = [*seq.drafts[:accepted[i]], next_tokens[i]]
            elif was_decode and not self.k:
                seq.accepted.append(0)               # a `none` artifact: every decode step accepts 0 drafts
            seq.drafts = next_drafts[i] if k else None               # target-only steps propose none
            seq.draft_probs = None if next_probs is None else next_probs[i]
            added = self._append(seq, new)
            if seq.logprobs is not None:
                self._collect_logprobs(seq, outputs, i, len(added))
            if seq.finish_reason is not None:
                finished.append(self._finish(seq, added))
            elif self.listener is not None:
                text = seq.text.take_visible() if seq.stream and seq.text is not None else ""
                self.listener(seq.request_id, added, text, None)
        return finished, verified

    def _collect_logprobs(self, seq: SequenceState, outputs: dict[str, np.ndarray], row: int, count: int) -> None:
        """Entries of the `count` tokens the row just added: positions 0 .. count - 1 of its K + 1 (drafts,
        then next_token), read from the graph's log-probability outputs."""
        emitted = outputs[io.EMITTED_LOGPROBS][row, :count].tolist()                     # [count]
        ranks = outputs[io.EMITTED_RANKS][row, :count].tolist()
        top = outputs[io.TOP_LOGPROBS][row, :count].tolist()                             # [count][N]
        top_ids = outputs[io.TOP_LOGPROB_IDS][row, :count].tolist()
        tokens = seq.generated[len(seq.generated) - count:]
        for j, token in enumerate(tokens):
            seq.logprobs.append(token_logprobs(token, emitted[j], ranks[j], top[j], top_ids[j], seq.params.logprobs,
                                               self.detokenize))
            seq.cumulative_logprob += emitted[j]

    # --- stopping -----------------------------------------------------------------------------------------

    def _append(self, seq: SequenceState, new: list[int]) -> list[int]:
        """Add tokens one at a time until a stop condition; returns those added."""
        for i, token in enumerate(new):
            if seq.grammar is not None and not seq.grammar.accept(token):
                seq.finish_reason = "error"      # unreachable while the graph applies the bitmask
                return new[:i]
            seq.add_token(token)
            if token in seq.stop_ids or (seq.grammar is not None and seq.grammar.terminated):
                seq.finish_reason = "stop"
                seq.stopped_by_token = token in seq.stop_ids or token in self.eos_token_ids
            elif seq.text is not None and seq.text.add(token):
                seq.finish_reason, seq.stop_at = "stop", seq.text.stop_at
            elif len(seq.generated) >= seq.max_new:
                seq.finish_reason = "length"
            if seq.finish_reason:
                return new[:i + 1]
        return new

    def _finish(self, seq: SequenceState, added: list[int]) -> RequestOutput:
        self.scheduler.remove(seq)
        collected = seq.logprobs is not None
        output = RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt,
                               token_ids=list(seq.generated), text=self.text_of(seq),
                               finish_reason=seq.finish_reason or "length", metrics=seq.metrics(self.k),
                               logprobs=list(seq.logprobs) if collected else None,
                               cumulative_logprob=seq.cumulative_logprob if collected else None)
        if self.listener is not None:
            self.listener(seq.request_id, added, "", output)
        return output

    def text_of(self, seq: SequenceState) -> str:
        """The request's text so far: without a stop string or a final stop token."""
        if self.detokenize is None:
            return ""
        if seq.stop_at is not None:
            return self.detokenize(seq.generated)[:seq.stop_at]   # the text ends before the stop string
        return self.detokenize(seq.generated[:-1] if seq.stopped_by_token else seq.generated)


def bounded(name: str, value: int | None, upper: int, *, lower: int) -> int:
    """A setting that may lower one of the artifact's limits: None (the limit itself) or an int in range."""
    if value is None:
        return upper
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise InvalidRequestError(f"{name}={value!r} is invalid; use an int in [{lower}, {upper}] (the "
                                  "artifact's limit)")
    return value
