"""One step's inputs, written in place into the host loop's persistent buffers, and where its KV commits.

Per step, for every scheduled row (runtime/sequence.py says which kind):

  prefill / recompute row:  tokens = the next chunk, drafts = -1, chunk_next_tokens = the token after
                            the chunk when there is one the step does not generate from (else -1)
  decode row:               tokens = [last generated token], drafts = the previous step's next_draft_tokens
                            (and draft_probs = its next_draft_probs, the q they were sampled from)
  commit:                   n = len(tokens) + num_accepted rows of the row's delta segment (len(tokens) + K
                            rows) go to positions cache_len .. cache_len + n - 1

Per-row sampling inputs come from each request's SamplingParams; `noise` from its own stream, one block
per generating step (zeros otherwise), so seeded output does not depend on the batch, on how the
prompt was chunked, or on preemptions; `token_bitmask` from its grammar (runtime/structured.py);
`in_thinking_phase` from its think-token tracking when it opted into relaxed acceptance.

Lean by construction (issue 18): each input is written with one numpy call from a list gathered over the
rows, into the same view objects for the same step geometry (looked up once per step), so a backend that
remembers what it bound rebinds nothing when a step repeats the last one's shape; the sampling
parameters are written only when the rows changed; a decode step's commit pairs come from a fixed
[B, K+1] grid instead of the ragged general case (runtime/pool_layout.py). (Each numpy call counts: the
graph's run leaves the host's caches cold, and measured at batch 16 the first calls after it take 10x their
warm time.)
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from runtime import manifest as io
from runtime.backend import PersistentInputBuffers, step_bounds
from runtime.blocks import BlockManager
from runtime.noise import batch_noise
from runtime.pool_layout import committed_slots
from runtime.scheduler import Plan

__all__ = ["StepFeeds"]

MAX_GEOMETRIES = 256       # step geometries whose views StepFeeds keeps (a decode batch repeats a few)
# input name -> the SamplingParams field it carries, one value per row
_PARAM_COLUMNS = ((io.TEMPERATURE, "temperature"), (io.TOP_K, "top_k"), (io.TOP_P, "top_p"), (io.MIN_P, "min_p"))


class StepFeeds:
    """Builds the feeds of a graph with K = `k` drafts per row (the artifact's K, or 0: target-only)."""

    def __init__(self, manifest: io.Manifest, specs: tuple[io.TensorSpec, ...], blocks: BlockManager) -> None:
        self.manifest, self.blocks, self.k = manifest, blocks, manifest.num_speculative_tokens
        self.buffers = PersistentInputBuffers(specs, step_bounds(manifest))
        held = set(self.buffers.names())
        self._params = tuple((name, field) for name, field in _PARAM_COLUMNS if name in held)
        self._param_rows: list | None = None                 # the rows whose sampling params the buffers hold
        # copied from, never grown: a row's positions plus one step's reach past them
        self._arange = np.arange(manifest.max_model_len + 1 + io.step_reach(self.k), dtype=np.int64)
        # (batch, tokens, table width, k, names) -> (views of every input, the feeds): see _geometry
        self._made: dict[tuple, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}
        self._no_drafts = [-1] * self.k                                               # [K]
        self._no_probs = np.zeros((self.k, manifest.vocab_size) if io.DRAFT_PROBS in held else (0, 0),
                                  dtype=np.float32)                                   # [K, V]: argmax drafts

    def build(self, plan: Plan, k: int, names: frozenset[str]) -> dict[str, np.ndarray]:
        m = self.manifest
        rows, counts = list(plan), list(plan.values())
        batch, total = len(rows), sum(counts)
        # only the blocks this step can touch (cache + fed tokens + the graph's reach): attention gathers every
        # block of the table, and a target-only step reaches 2K positions less than the rows hold blocks for
        bs, reach = m.block_size, io.step_reach(k)
        tables = [self.blocks.table(s.request_id)[:-(-(s.cache_len + n + reach) // bs)] for s, n in plan.items()]
        width = max(map(len, tables))
        f, feeds = self._geometry(batch, total, width, k, names)
        f[io.BLOCK_TABLE][...] = [t + [0] * (width - len(t)) for t in tables]   # padding: masked by cache_lengths
        f[io.ROW_OFFSETS][...] = [0, *accumulate(counts)]
        cache = f[io.CACHE_LENGTHS]
        cache[...] = [s.cache_len for s in rows]
        if total == batch:              # one token per row (decode): the token at, and the position of, cache_len
            f[io.TOKENS][...] = [s.token_at(s.cache_len) for s in rows]
            f[io.POSITIONS][...] = cache
        else:
            f[io.TOKENS][...] = [t for s, n in plan.items() for t in s.tokens(s.cache_len, s.cache_len + n)]
            starts = np.repeat(cache - f[io.ROW_OFFSETS][:-1], counts)                     # [S]
            np.add(starts, self._arange[:total], out=f[io.POSITIONS])
        decode = [s.is_decode and s.drafts is not None for s in rows]                  # rows with drafts to verify
        if k:
            f[io.DRAFT_TOKENS][...] = [s.drafts if d else self._no_drafts for s, d in zip(rows, decode)]
        if io.DRAFT_PROBS in names:     # each decode row's q from its previous step; zeros (argmax drafts) elsewhere
            f[io.DRAFT_PROBS][...] = [s.draft_probs if d and s.draft_probs is not None else self._no_probs
                                      for s, d in zip(rows, decode)]
        self._per_row_inputs(f, plan, k, names)
        return feeds

    def _geometry(self, batch: int, total: int, width: int, k: int,
                  names: frozenset[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(every input's view at this step geometry, the feeds: those of `names`), made once per geometry."""
        key = (batch, total, width, k, names)
        made = self._made.get(key)
        if made is None:
            m, view = self.manifest, self.buffers.view
            shapes = {io.ROW_OFFSETS: (batch + 1,), io.TOKENS: (total,), io.POSITIONS: (total,),
                      io.BLOCK_TABLE: (batch, width), io.DRAFT_TOKENS: (batch, k),
                      io.DRAFT_PROBS: (batch, self.k, m.vocab_size), io.NOISE: (batch, self.k + 1, m.noise_channels),
                      io.TOKEN_BITMASK: (batch, k + 1, -(-m.vocab_size // 32))}
            f = {name: view(name, shapes.get(name, (batch,))) for name in self.buffers.names()}
            # Every generating step takes a K + 1 block from the request's stream, whichever graph runs.
            feeds = {name: f[name][:, :k + 1] if name == io.NOISE and k < self.k else f[name] for name in names}
            if len(self._made) >= MAX_GEOMETRIES:
                self._made.clear()
            made = self._made[key] = (f, feeds)
        return made

    def _per_row_inputs(self, f: dict[str, np.ndarray], plan: Plan, k: int, names: frozenset[str]) -> None:
        rows = list(plan)
        generating = [s.generates(n) for s, n in plan.items()]
        if io.CHUNK_NEXT_TOKENS in names:
            f[io.CHUNK_NEXT_TOKENS][...] = [-1 if g else s.token_at(s.cache_len + n)
                                            for (s, n), g in zip(plan.items(), generating)]
        if io.IN_THINKING_PHASE in names:
            f[io.IN_THINKING_PHASE][...] = [s.thinking for s in rows]
        if rows != self._param_rows:    # the same rows as the last step: their parameters are in place
            self._param_rows = None
            for name, field in self._params:
                f[name][...] = [getattr(s.params, field) for s in rows]
            self._param_rows = rows
        batch_noise([s.noise if g else None for s, g in zip(rows, generating)], self.k + 1,
                    self.manifest.noise_channels, out=f[io.NOISE])
        if io.TOKEN_BITMASK in names:
            bitmask = f[io.TOKEN_BITMASK]
            bitmask[...] = -1                        # unconstrained rows: every token allowed
            for i, (s, g) in enumerate(zip(rows, generating)):
                if g and s.grammar is not None:
                    s.grammar.fill_rows(bitmask[i], s.drafts if s.is_decode and k else None)

    def commit_pairs(self, feeds: dict[str, np.ndarray], num_accepted: np.ndarray,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
        """The commit rule as (pool slot, delta row) pairs, [N] each (runtime/pool_layout.py)."""
        return committed_slots(feeds[io.ROW_OFFSETS], num_accepted, feeds[io.CACHE_LENGTHS], feeds[io.BLOCK_TABLE],
                               num_speculative_tokens=k, block_size=self.manifest.block_size)
