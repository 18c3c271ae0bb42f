"""What every unified step module shares: its named input/output lists and the target's pools.

A step's forward takes the method's inputs positionally in `input_names` order (torch.export accepts the
varargs and the ONNX graph gets exactly these names), so one class serves targets with one pool (Llama,
DeepSeek) or two (Gemma 4) and drafters with or without a pool of their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from export.step import spec_glue as spec
from runtime import manifest as io

LEADING_INPUTS = (io.TOKENS, io.ROW_OFFSETS, io.POSITIONS, io.CACHE_LENGTHS, io.BLOCK_TABLE, io.DRAFT_TOKENS)
SAMPLING_INPUTS = (io.CHUNK_NEXT_TOKENS, io.TEMPERATURE, io.TOP_K, io.TOP_P, io.MIN_P, io.NOISE,
                   io.IN_THINKING_PHASE)
LEADING_OUTPUTS = (io.NUM_ACCEPTED, io.NEXT_TOKENS, io.NEXT_DRAFT_TOKENS)
# Steps with drafts (K >= 1) also carry the distributions the drafts were sampled from, step to step.
DRAFT_PROBS_INPUTS, DRAFT_PROBS_OUTPUTS = (io.DRAFT_PROBS,), (io.NEXT_DRAFT_PROBS,)


def target_pools(target: nn.Module) -> tuple[str, ...]:
    """Pool input names a target reads (its forward takes them in this order after block_table)."""
    return tuple(target.pool_names)


class UnifiedStep(nn.Module):
    """Base class: subclasses set `k`, `target_pool_names`, `draft_pool_names` and implement `step`."""

    k: int
    target: nn.Module
    target_pool_names: tuple[str, ...]
    draft_pool_names: tuple[str, ...] = ()
    structured_output: bool = False
    max_logprobs: int = io.DEFAULT_MAX_LOGPROBS   # N of top_logprobs; 0: no log-probability outputs

    @property
    def input_names(self) -> tuple[str, ...]:
        bitmask = (io.TOKEN_BITMASK,) if self.structured_output else ()
        probs = DRAFT_PROBS_INPUTS if self.k else ()
        return LEADING_INPUTS + self.target_pool_names + self.draft_pool_names + SAMPLING_INPUTS + probs + bitmask

    @property
    def output_names(self) -> tuple[str, ...]:
        deltas = tuple(io.DELTA_OF_POOL[p] for p in self.target_pool_names + self.draft_pool_names)
        logprobs = io.LOGPROB_OUTPUTS if self.max_logprobs else ()
        return LEADING_OUTPUTS + (DRAFT_PROBS_OUTPUTS if self.k else ()) + deltas + logprobs

    @property
    def vocab_size(self) -> int:
        return int(self.target.embed_tokens.num_embeddings)

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        """(layers, width) of every pool input, target pools first."""
        shapes = dict(self.target.pool_shapes())
        drafter = getattr(self, "drafter", None)
        if drafter is not None and self.draft_pool_names:
            shapes.update(drafter.pool_shapes())
        return shapes

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.step(dict(zip(self.input_names, inputs, strict=True)))

    def step(self, f: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def logprob_outputs(self, logits: torch.Tensor, drafts: torch.Tensor, verdict: spec.Verdict) -> tuple[torch.Tensor, ...]:
        """The log-probability outputs (io.LOGPROB_OUTPUTS, last in `output_names`) of logits [B, K+1, V] and
        drafts [B, K]; () when the step has none."""
        if not self.max_logprobs:
            return ()
        return tuple(spec.token_logprobs(logits, drafts, verdict, self.max_logprobs))

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named feeds -> named outputs (the reference loop's `RunStep`); a missing `draft_probs` is zeros
        (argmax drafts: what a loop without sampled drafts, or rows without drafts, have)."""
        if io.DRAFT_PROBS in self.input_names and io.DRAFT_PROBS not in feeds:
            batch = feeds[io.DRAFT_TOKENS].shape[0]
            feeds = {**feeds, io.DRAFT_PROBS: torch.zeros(batch, self.k, self.vocab_size)}
        with torch.no_grad():
            outputs: Sequence[torch.Tensor] = self(*[feeds[name] for name in self.input_names])
        return dict(zip(self.output_names, outputs, strict=True))
