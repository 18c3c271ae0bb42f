"""The host loop: schedules requests into steps, fills the step inputs, commits KV, collects tokens.

It drives an artifact's unified step exactly as the torch reference loop (export/generate.py) does, with
numpy, a BlockManager and persistent input buffers (DESIGN.md §3, §7). Per step, for every scheduled row:

  prefill row:  tokens = the next prompt chunk, drafts = -1, chunk_next_tokens = the following prompt
                token when the prompt continues (else -1); nothing is generated until the last chunk
  decode row:   tokens = [last next_token], drafts = the previous step's next_draft_tokens
  commit:       n = len(tokens) + num_accepted rows of the row's delta segment (len(tokens) + K rows)
                go to positions cache_len .. cache_len + n - 1
  generated:    the accepted drafts, then next_token

Rows join between steps (first come, first served, while batch slots and blocks last) and leave when they
finish; prefill is chunked so a step never exceeds the artifact's `max_tokens_per_step`. A request is
admitted only when the blocks its longest possible life needs are free, so a running request never runs
out of blocks (preemption is the full runtime's).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from runtime import manifest as io
from runtime.backend import Backend, PersistentInputBuffers, step_bounds
from runtime.blocks import BlockManager
from runtime.errors import InvalidRequestError
from runtime.noise import RequestNoise, batch_noise
from runtime.sampling_params import SamplingParams

__all__ = ["Engine", "RequestMetrics", "RequestOutput", "validate_prompt"]

Detokenize = Callable[[Sequence[int]], str]


@dataclass(frozen=True, kw_only=True)
class RequestMetrics:
    num_steps: int                               # steps the request took part in, prefill chunks included
    accepted_per_step: tuple[int, ...]           # num_accepted of each decode step
    acceptance_per_position: tuple[float, ...]   # [K] share of decode steps that accepted draft j
    mean_accepted_length: float                  # tokens committed per decode step: 1 + mean accepted
    num_generated: int
    elapsed_s: float                             # admission to finish
    tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    request_id: Hashable
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str                                    # "" without a tokenizer
    finish_reason: str                           # "length" | "stop"
    metrics: RequestMetrics


@dataclass(eq=False)
class _Sequence:
    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    max_new: int
    worst_blocks: int                            # blocks of its longest life, promised at admission
    noise: RequestNoise
    prefilled: int = 0
    cache_len: int = 0
    next_token: int = -1
    drafts: np.ndarray | None = None             # [K] drafts to verify next step
    generated: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    num_steps: int = 0
    admitted_at: float = 0.0
    finish_reason: str | None = None
    stop_at: int | None = None                   # text length where a stop string begins

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)


def validate_prompt(prompt: Sequence[int], manifest: io.Manifest, where: str = "prompt") -> None:
    """One-line InvalidRequestError for an empty, out-of-vocabulary or too long prompt."""
    if len(prompt) == 0:
        raise InvalidRequestError(f"{where} is empty; give at least one token")
    for i, token in enumerate(prompt):
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < manifest.vocab_size:
            raise InvalidRequestError(f"{where} token {i} is {token!r}; token ids must be ints in "
                                      f"[0, {manifest.vocab_size}) for this artifact")
    if len(prompt) >= manifest.max_model_len:
        raise InvalidRequestError(f"{where} has {len(prompt)} tokens; this artifact's max_model_len is "
                                  f"{manifest.max_model_len}, so prompts must be shorter than that")


class Engine:
    """Continuous batching over one backend; `add_request` between `step` calls, `step` until done."""

    def __init__(self, backend: Backend, *, eos_token_ids: Sequence[int] = (),
                 detokenize: Detokenize | None = None, prefill_chunk: int | None = None) -> None:
        m = self.manifest = backend.manifest
        self.backend, self.k = backend, m.num_speculative_tokens
        self.eos_token_ids, self.detokenize = frozenset(eos_token_ids), detokenize
        self.prefill_chunk = min(prefill_chunk or m.max_tokens_per_step, m.max_tokens_per_step)
        self.blocks = BlockManager(backend.num_blocks, m.block_size)
        specs = backend.input_specs()
        self.buffers = PersistentInputBuffers(specs, step_bounds(m))
        self._input_names = {s.name for s in specs}
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._promised = 0                       # worst-case blocks of the running requests
        self._ids = count()

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> tuple[int, int]:
        """(new tokens at most, worst-case blocks) of a request; InvalidRequestError if it cannot run."""
        validate_prompt(prompt, self.manifest)
        max_new = min(params.max_tokens, self.manifest.max_model_len - len(prompt))
        worst = self.blocks.blocks_for(len(prompt) + max_new + 2 * self.k + 1)
        if worst > self.blocks.num_blocks:
            raise InvalidRequestError(f"a {len(prompt)}-token prompt with max_tokens={max_new} needs {worst} KV "
                                      f"blocks, the pool has {self.blocks.num_blocks}; give the LLM more "
                                      "num_blocks / kv_memory_bytes or lower max_tokens")
        return max_new, worst

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        params = params or SamplingParams()
        max_new, worst = self.check_request(prompt, params)
        request_id = next(self._ids) if request_id is None else request_id
        if any(s.request_id == request_id for s in (*self.waiting, *self.running)):
            raise InvalidRequestError(f"request id {request_id!r} is already in use; give each request its own")
        self.waiting.append(_Sequence(request_id, [int(t) for t in prompt], params, max_new, worst,
                                      RequestNoise(params.seed)))
        return request_id

    def abort(self, request_id: Hashable) -> None:
        """Drop a request wherever it is; its blocks go back to the pool."""
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.running.remove(seq)
            self._promised -= seq.worst_blocks
            if request_id in self.blocks:
                self.blocks.free(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        """Run one step over the scheduled rows; returns the requests that finished in it."""
        plan = self._schedule()
        if not plan:
            return []
        feeds = self._feeds(plan)
        outputs = self.backend.run(feeds)
        self._commit(plan, feeds, outputs)
        return self._advance(plan, outputs)

    # --- scheduling ---------------------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.manifest.max_batch_size:
            seq = self.waiting[0]
            if self._promised + seq.worst_blocks > self.blocks.num_blocks:
                return                           # first come, first served: wait for blocks to free
            self.waiting.popleft()
            self._promised += seq.worst_blocks
            seq.admitted_at = time.perf_counter()
            self.running.append(seq)

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """(row, new tokens this step): decode rows first, then prefill chunks within the token budget."""
        self._admit()
        budget, plan = self.manifest.max_tokens_per_step, []
        for seq in self.running:
            if not seq.prefilling and budget > 0:
                plan.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.prefilling and budget > 0:
                n = min(len(seq.prompt) - seq.prefilled, self.prefill_chunk, budget)
                plan.append((seq, n))
                budget -= n
        for seq, n in plan:
            # merged positions plus the K-1 sequential draft steps write KV (DESIGN.md §3)
            self.blocks.allocate(seq.request_id, seq.cache_len + n + 2 * self.k + 1)
        return plan

    # --- one step -----------------------------------------------------------------------------------------

    def _feeds(self, plan: list[tuple[_Sequence, int]]) -> dict[str, np.ndarray]:
        view, k, batch = self.buffers.view, self.k, len(plan)
        lengths = np.array([n for _, n in plan], dtype=np.int64)                        # [B]
        tables = [self.blocks.table(seq.request_id) for seq, _ in plan]
        f = {io.ROW_OFFSETS: view(io.ROW_OFFSETS, (batch + 1,)),
             io.TOKENS: view(io.TOKENS, (int(lengths.sum()),)),
             io.POSITIONS: view(io.POSITIONS, (int(lengths.sum()),)),
             io.BLOCK_TABLE: view(io.BLOCK_TABLE, (batch, max(len(t) for t in tables))),
             io.DRAFT_TOKENS: view(io.DRAFT_TOKENS, (batch, k))}
        f[io.ROW_OFFSETS][0] = 0
        np.cumsum(lengths, out=f[io.ROW_OFFSETS][1:])
        f[io.BLOCK_TABLE][...] = 0                   # padding entries: never read (masked by cache_lengths)
        for i, ((seq, n), table) in enumerate(zip(plan, tables)):
            start = f[io.ROW_OFFSETS][i]
            f[io.TOKENS][start:start + n] = seq.prompt[seq.prefilled:seq.prefilled + n] if seq.prefilling \
                else seq.next_token
            f[io.POSITIONS][start:start + n] = np.arange(seq.cache_len, seq.cache_len + n)
            f[io.BLOCK_TABLE][i, :len(table)] = table
            f[io.DRAFT_TOKENS][i] = -1 if seq.prefilling or seq.drafts is None else seq.drafts
        self._per_row_inputs(f, plan)
        return {name: value for name, value in f.items() if name in self._input_names}

    def _per_row_inputs(self, f: dict[str, np.ndarray], plan: list[tuple[_Sequence, int]]) -> None:
        view, batch, m = self.buffers.view, len(plan), self.manifest
        rows = [seq for seq, _ in plan]
        columns = {
            io.CACHE_LENGTHS: [s.cache_len for s in rows],
            io.CHUNK_NEXT_TOKENS: [s.prompt[s.prefilled + n] if s.prefilled + n < len(s.prompt) else -1
                                   for s, n in plan],
            io.TEMPERATURE: [s.params.temperature for s in rows], io.TOP_K: [s.params.top_k for s in rows],
            io.TOP_P: [s.params.top_p for s in rows], io.MIN_P: [s.params.min_p for s in rows],
            io.IN_THINKING_PHASE: [False] * batch,   # thinking-phase tracking arrives with the full runtime
        }
        for name, values in columns.items():
            if name in self._input_names:
                f[name] = view(name, (batch,))
                f[name][...] = values
        f[io.NOISE] = batch_noise([s.noise for s in rows], self.k + 1, m.noise_channels,
                                  out=view(io.NOISE, (batch, self.k + 1, m.noise_channels)))
        if io.TOKEN_BITMASK in self._input_names:   # structured output arrives later: allow every token
            f[io.TOKEN_BITMASK] = view(io.TOKEN_BITMASK, (batch, self.k + 1, -(-m.vocab_size // 32)))
            f[io.TOKEN_BITMASK][...] = -1

    def _commit(self, plan: list[tuple[_Sequence, int]], feeds: dict[str, np.ndarray],
                outputs: dict[str, np.ndarray]) -> None:
        """The commit rule, vectorised: every committed (row, position) pair becomes one (slot, delta row)."""
        batch, bs = len(plan), self.manifest.block_size
        lengths = np.diff(feeds[io.ROW_OFFSETS])                                         # [B]
        counts = lengths + outputs[io.NUM_ACCEPTED]                                      # [B]
        seg_starts = feeds[io.ROW_OFFSETS][:-1] + np.arange(batch) * self.k              # [B] in the delta
        row_of = np.repeat(np.arange(batch), counts)                                     # [N]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)   # [N]
        positions = feeds[io.CACHE_LENGTHS][row_of] + within                             # [N]
        slots = feeds[io.BLOCK_TABLE][row_of, positions // bs] * bs + positions % bs     # [N]
        self.backend.commit(outputs, slots, seg_starts[row_of] + within)

    def _advance(self, plan: list[tuple[_Sequence, int]], outputs: dict[str, np.ndarray]) -> list[RequestOutput]:
        accepted = outputs[io.NUM_ACCEPTED].tolist()
        next_tokens = outputs[io.NEXT_TOKENS].tolist()
        next_drafts = outputs[io.NEXT_DRAFT_TOKENS]                                      # [B, K]
        finished = []
        for i, (seq, n) in enumerate(plan):
            seq.num_steps += 1
            seq.cache_len += n + accepted[i]
            if seq.prefilling:
                seq.prefilled += n
                if seq.prefilling:
                    continue                     # the prompt continues: this step's next token is ignored
                new = [next_tokens[i]]
            else:
                seq.accepted.append(accepted[i])
                new = [*seq.drafts[:accepted[i]].tolist(), next_tokens[i]]
            seq.next_token, seq.drafts = next_tokens[i], next_drafts[i].copy()
            if self._append(seq, new):
                finished.append(self._finish(seq))
        return finished

    # --- stopping -----------------------------------------------------------------------------------------

    def _append(self, seq: _Sequence, new: list[int]) -> bool:
        """Add tokens one at a time until a stop condition; True when the request is done."""
        stop_ids = seq.params.stop_token_ids | (frozenset() if seq.params.ignore_eos else self.eos_token_ids)
        for token in new:
            seq.generated.append(token)
            if token in stop_ids or self._hit_stop_string(seq):
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.max_new:
                seq.finish_reason = "length"
            if seq.finish_reason:
                return True
        return False

    def _hit_stop_string(self, seq: _Sequence) -> bool:
        if not seq.params.stop_strings or self.detokenize is None:
            return False
        text = self.detokenize(seq.generated)
        hits = [text.find(s) for s in seq.params.stop_strings if s in text]
        if hits:
            seq.stop_at = min(hits)
        return bool(hits)

    def _finish(self, seq: _Sequence) -> RequestOutput:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        self._promised -= seq.worst_blocks
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt, token_ids=seq.generated,
                             text=self._text(seq), finish_reason=seq.finish_reason or "length",
                             metrics=_metrics(seq, self.k))

    def _text(self, seq: _Sequence) -> str:
        if self.detokenize is None:
            return ""
        if seq.stop_at is not None:
            return self.detokenize(seq.generated)[:seq.stop_at]   # the text ends before the stop string
        stopped_by_token = seq.finish_reason == "stop"
        return self.detokenize(seq.generated[:-1] if stopped_by_token else seq.generated)


def _metrics(seq: _Sequence, k: int) -> RequestMetrics:
    accepted = np.array(seq.accepted, dtype=np.int64)                                     # [decode steps]
    per_position = tuple(float((accepted > j).mean()) if accepted.size else 0.0 for j in range(k))
    elapsed = time.perf_counter() - seq.admitted_at
    return RequestMetrics(
        num_steps=seq.num_steps, accepted_per_step=tuple(seq.accepted), acceptance_per_position=per_position,
        mean_accepted_length=1.0 + float(accepted.mean()) if accepted.size else 1.0,
        num_generated=len(seq.generated), elapsed_s=elapsed,
        tokens_per_s=len(seq.generated) / elapsed if elapsed > 0 else 0.0)
