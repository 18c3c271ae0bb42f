"""Draft models trained on their target's own outputs, through the modules the export builds.

Data: windows of the training stream cut to a short prompt, continued by the target (transformers
`generate`), greedily and, for the bundled drafts, also by sampling. A draft learns either the target's argmax
at every position (cross-entropy, what greedy acceptance rewards) or its whole distribution (KL, what
rejection sampling's acceptance rewards; `Distill`). The frozen target's features (final-normed hidden,
captured layer outputs, K/V rows, logits) come from the export's own target module, exactly as the step
graph computes them.

Each draft is built by the method's own builder (`export.methods.METHODS[...]`) from an in-memory
checkpoint, trained with the custom ops swapped for their differentiable references, and written back
through the inverse of its weight adapter, so what is saved is what the export reads.

Unrolled draft steps ("training-time test"): sequential drafters run step 0 over whole sequences (token j+1
with the target feature of j, the EAGLE/MTP shift), then steps s = 1 .. K-1 per anchor a, at position a + s,
feeding the previous step's carried state, over a working cache holding step-0 rows at slots <= a and the
anchor's own step-t rows at a + t, exactly the cache the step graph builds. DFlash runs its block forward
from anchors c with the context rows of positions < c.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from export.train.common import Schedule, differentiable_ops, invert_adapter, train_loop

STEP_WEIGHT = 0.8        # loss weight of draft position s is STEP_WEIGHT ** s


class MemoryCheckpoint(dict):
    """A draft checkpoint held in memory, shaped like `export.checkpoint.Checkpoint` for the builders."""

    def __init__(self, config: dict[str, Any], tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        super().__init__(tensors)
        self.config, self.path = config, path


@dataclass(frozen=True)
class Distill:
    """What a draft learns from the target at each position.

    "ce": cross-entropy on the target's argmax, drafted tokens fed as that argmax (greedy decoding's drafts).
    "kl": KL(p_T || q_T) from the target's whole distribution to the draft's, both at `temperature`, teacher
    forced on the sequence's own tokens: the rejection sampler accepts sum_x min(p(x), q(x)) = 1 - TV(p, q),
    which only a draft matching the whole distribution can raise; argmax labels make q peaked and cap it at
    about p's largest probability.
    """

    loss: str = "ce"
    temperature: float = 1.0

    def recipe(self) -> dict[str, Any]:
        return {"loss": self.loss, "temperature": self.temperature}


CE = Distill()


@dataclass
class TargetData:
    tokens: torch.Tensor      # [N, n] prompt + the target's continuation (greedy or sampled)
    labels: torch.Tensor      # [N, n] target argmax at every position (prediction of the next token)
    hidden: torch.Tensor      # [N, n, H] final-normed
    captured: torch.Tensor    # [N, n, C, H]
    deltas: dict[str, torch.Tensor]   # pool name -> [N, n, L, W]
    logits: torch.Tensor | None = None   # [N, n, V] float16, kept for "kl" distillation and the figures
    distill: Distill = CE

    def fed(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token fed to a later draft step as token `positions + 1` (the draft of prediction
        `positions`): the target's argmax under "ce", else the sequence's own token."""
        if self.distill.loss == "ce":
            return self.labels[rows, positions]
        return self.tokens[rows, positions + 1]

    def losses(self, draft_logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[A]: the draft's loss at prediction `positions` of `rows` under this data's Distill."""
        if self.distill.loss == "ce":
            return F.cross_entropy(draft_logits.float(), self.labels[rows, positions], reduction="none")
        return kl_divergence(draft_logits, self.logits[rows, positions].float(), self.distill.temperature)


def kl_divergence(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[A]: KL(p_T || q_T), p the target's distribution and q the draft's, both at `temperature`."""
    log_p = F.log_softmax(target_logits / temperature, dim=-1)
    return (log_p.exp() * (log_p - F.log_softmax(draft_logits.float() / temperature, dim=-1))).sum(-1)


@torch.no_grad()
def target_sequences(target_dir: Path, train_ids: torch.Tensor, *, count: int, prompt_len: int, total_len: int,
                     seed: int, log: Callable[[str], None], sampling: Mapping[str, float] | None = None) -> torch.Tensor:
    """[count, total_len]: training-stream prompts continued by the target (transformers generate), greedily,
    or sampled with `sampling` (temperature, top_p) from a generator seeded with `seed`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_ids.numel() - prompt_len, (count,), generator=gen).tolist()
    prompts = torch.stack([train_ids[s:s + prompt_len] for s in starts])
    how = {"do_sample": True, "top_k": 0, **sampling} if sampling else {"do_sample": False}
    out = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for chunk in prompts.split(128):
            out.append(model.generate(chunk, attention_mask=torch.ones_like(chunk), **how,
                                      max_new_tokens=total_len - prompt_len, min_new_tokens=total_len - prompt_len,
                                      pad_token_id=model.config.pad_token_id))
            log(f"  generated {sum(o.shape[0] for o in out)}/{count} target continuations ({'sampled' if sampling else 'greedy'})")
    return torch.cat(out)


@torch.no_grad()
def target_features(target: torch.nn.Module, tokens: torch.Tensor, *, rows_per_call: int = 8,
                    distill: Distill = CE) -> TargetData:
    """Run the export's target module over whole sequences (empty pools), keeping every position's outputs
    (the logits in float16: soft labels for "kl", and the acceptance figures)."""
    n = tokens.shape[1]
    saved, target.num_logits = target.num_logits, n
    shapes = target.pool_shapes()
    parts: list[tuple[torch.Tensor, ...]] = []
    try:
        with differentiable_ops():          # the batched attention is also the fast one
            for chunk in tokens.split(rows_per_call):
                b = chunk.shape[0]
                pools = [torch.zeros(1, layers, 1, width) for layers, width in shapes.values()]
                logits, hidden, captured, *deltas = target(
                    chunk.reshape(-1), torch.arange(b + 1) * n, torch.arange(n).repeat(b),
                    torch.zeros(b, dtype=torch.int64), torch.zeros(b, 1, dtype=torch.int64), *pools)
                parts.append((logits.argmax(-1), logits.view(b, n, -1).half(), hidden.view(b, n, -1),
                              captured.view(b, n, *captured.shape[1:]), *(d.view(b, n, *d.shape[1:]) for d in deltas)))
    finally:
        target.num_logits = saved
    cols = [torch.cat(c) for c in zip(*parts)]
    return TargetData(tokens=tokens, labels=cols[0], logits=cols[1], hidden=cols[2], captured=cols[3],
                      deltas=dict(zip(shapes, cols[4:])), distill=distill)


# --- losses ---------------------------------------------------------------------------------------------------
#
# Each drafter kind lists its predictions, one entry per draft position s: (the draft's logits [A, V], the
# sequence rows [A] and prediction positions [A] they are scored at). `draft_loss` weighs position s by
# STEP_WEIGHT ** s; `accuracy` reads the same entries for its figures.

Predictions = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def sequential_predictions(step: torch.nn.Module, data: TargetData, rows: torch.Tensor, *, num_anchors: int,
                           gen: torch.Generator) -> Predictions:
    """Unrolled K steps of a drafter with its own one-layer pool (Eagle3, MTP/NextN)."""
    from export.step.sequential import DraftBatch

    drafter, k = step.drafter, step.k
    tokens = data.tokens[rows]                                                          # [B, n]
    b, n = tokens.shape
    hidden = drafter.feature(data.hidden[rows].flatten(0, 1), data.captured[rows].flatten(0, 1))  # [B*n, F]
    zeros = torch.zeros(b, dtype=torch.int64)
    # step 0 at j < n-1: token j+1 with the feature of j -> predicts the target's token after j+1
    shifted = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1).reshape(-1)             # [B*n]
    batch = DraftBatch(shifted, hidden, torch.arange(n).repeat(b), torch.arange(b + 1) * n, zeros, zeros)
    cache = (hidden.new_zeros(1, b, 1, _pool_width(drafter)),)
    carry, head_in, (rows0,) = drafter(batch, cache)                                    # rows0 [B*n, 1, W]
    valid = n - 1 - k                                                                   # anchors a < valid
    predictions = [(drafter.logits(head_in.view(b, n, -1)[:, :n - 2].flatten(0, 1)),
                    rows[:, None].expand(b, n - 2).reshape(-1), torch.arange(1, n - 1).repeat(b))]
    # anchors for the later steps
    anchor_row = torch.randint(0, b, (num_anchors,), generator=gen)
    anchor_pos = torch.randint(0, valid, (num_anchors,), generator=gen)
    flat = anchor_row * n + anchor_pos
    context = rows0[:, 0].view(b, n, -1)[anchor_row]                                    # [A, n, W]
    carry, own = carry[flat], []
    one_each = torch.arange(num_anchors + 1)
    for s in range(1, k):
        position = anchor_pos + s                                                       # [A]
        cache_s = context.clone()
        for t, row in enumerate(own, start=1):
            cache_s[torch.arange(num_anchors), anchor_pos + t] = row
        batch = DraftBatch(data.fed(rows[anchor_row], anchor_pos + s), carry, position, one_each, position,
                           anchor_pos + 1)
        carry, head_in, (new_rows,) = drafter(batch, (cache_s[None],))
        own.append(new_rows[:, 0])
        predictions.append((drafter.logits(head_in), rows[anchor_row], anchor_pos + s + 1))
    return predictions


def _pool_width(drafter: torch.nn.Module) -> int:
    (_, width), = drafter.pool_shapes().values()
    return width


def assistant_predictions(step: torch.nn.Module, data: TargetData, rows: torch.Tensor, *, num_anchors: int,
                          gen: torch.Generator) -> Predictions:
    """Unrolled K steps of the Gemma 4 assistant: one query per anchor at the constant position
    committed = a + 1, reading the target's K/V of positions <= a (its Q-only layers own no cache)."""
    from export.archs.gemma4.config import LAYER_TYPES
    from export.archs.gemma4.model import POOL_NAMES
    from export.step.sequential import DraftBatch

    drafter, k = step.drafter, step.k
    n = data.tokens.shape[1]
    anchor_row = rows[torch.randint(0, rows.numel(), (num_anchors,), generator=gen)]
    anchor_pos = torch.randint(1, n - 1 - k, (num_anchors,), generator=gen)           # a >= 1: a row has a past
    cache = tuple(data.deltas[POOL_NAMES[t]][anchor_row][:, :, drafter.kv_slots[t]] for t in LAYER_TYPES)  # [A, n, W]
    one_each = torch.arange(num_anchors + 1)
    committed = anchor_pos + 1
    tokens, hidden = data.tokens[anchor_row, anchor_pos + 1], data.hidden[anchor_row, anchor_pos]
    predictions = []
    for s in range(k):
        batch = DraftBatch(tokens, hidden, anchor_pos + s, one_each, committed, committed)
        hidden, head_in, _ = drafter(batch, cache)
        predictions.append((drafter.logits(head_in), anchor_row, anchor_pos + s + 1))
        tokens = data.fed(anchor_row, anchor_pos + s + 1)
    return predictions


def block_predictions(step: torch.nn.Module, data: TargetData, rows: torch.Tensor, *, num_anchors: int,
                      gen: torch.Generator) -> Predictions:
    """DFlash: context rows materialized from the target taps of every position; blocks anchored at c with
    the token at c first and mask tokens after it, reading the rows of positions < c; position i of the
    block predicts the target's token after c + i."""
    drafter, k = step.drafter, step.k
    tokens = data.tokens[rows]                                                          # [B, n]
    b, n = tokens.shape
    positions = torch.arange(n).repeat(b)
    (context,) = drafter.materialize(data.captured[rows].flatten(0, 1), positions)      # [B*n, Ld, W]
    context = context.view(b, n, *context.shape[1:])                                    # [B, n, Ld, W]
    anchor_row = torch.randint(0, b, (num_anchors,), generator=gen)
    anchor_pos = torch.randint(1, n - k, (num_anchors,), generator=gen)                 # c
    cache = context[anchor_row].permute(2, 0, 1, 3)                                     # [Ld, A, n, W]
    hidden = drafter.block_hidden(tokens[anchor_row, anchor_pos], anchor_pos, (cache,))  # [A, K, H]
    logits = drafter.logits(hidden.flatten(0, 1)).view(num_anchors, k, -1)             # [A, K, V]
    return [(logits[:, i], rows[anchor_row], anchor_pos + i) for i in range(k)]


def draft_loss(predictions: Predictions, data: TargetData) -> torch.Tensor:
    """The loss of draft position s weighted by STEP_WEIGHT ** s."""
    weights = [STEP_WEIGHT ** s for s in range(len(predictions))]
    return sum(w * data.losses(logits, r, p).mean() for w, (logits, r, p) in zip(weights, predictions)) / sum(weights)


# The method registry's drafter kind (export/methods.py) -> its predictions.
PREDICTIONS = {"block": block_predictions, "sequential": sequential_predictions, "assistant": assistant_predictions}


def predictions_for(method: str) -> Callable[..., Predictions]:
    from export.methods import METHODS

    return PREDICTIONS[METHODS[method].drafter]


# --- training and write-back ----------------------------------------------------------------------------------

def build_step(method: str, target_dir: Path, draft: MemoryCheckpoint | None, k: int) -> torch.nn.Module:
    """The export's step module for `method` (fp32), its target frozen."""
    from export.checkpoint import Checkpoint
    from export.methods import METHODS

    step = METHODS[method].build(Checkpoint.open(target_dir), draft, k=k)
    step.target.requires_grad_(False)
    return step


def draft_parameters(step: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The drafter's own parameters (shared target tensors stay frozen)."""
    frozen = {id(p) for p in step.target.parameters()}
    return [p for p in step.drafter.parameters() if id(p) not in frozen]


# How the bench and most users sample: the bundled drafts' sampled training data (pipeline.SAMPLED_DATA) and the
# acceptance figure below.
SAMPLING = {"temperature": 0.7, "top_p": 0.95}


def accuracy(step: torch.nn.Module, method: str, data: TargetData, *, seed: int) -> dict[str, Any]:
    """Held-out figures over fixed anchors (the same seed every time): the training loss; per draft position,
    how often the draft's argmax is the target's (greedy acceptance, given the earlier drafts were right);
    and the expected rejection-sampling acceptance sum_x min(p(x), q(x)) at SAMPLING, p the target's
    truncated distribution and q the draft's untruncated one at that temperature, as the step graph draws."""
    from plugins.spec_accept.truncation import truncated_probs

    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(data.tokens.shape[0])
    t, top_p = SAMPLING["temperature"], SAMPLING["top_p"]
    with torch.no_grad():
        predictions = predictions_for(method)(step, data, rows, num_anchors=512, gen=gen)
        loss = draft_loss(predictions, data)
        top1, accept = [], []
        for logits, r, p in predictions:
            target = data.logits[r, p].float()
            top1.append(float((logits.argmax(-1) == target.argmax(-1)).float().mean()))
            ones = torch.ones(target.shape[0])
            probs = truncated_probs(target, ones * t, torch.zeros_like(ones, dtype=torch.int64), ones * top_p,
                                    torch.zeros_like(ones))
            q = F.softmax(logits.double() / t, dim=-1)
            accept.append(float(torch.minimum(probs, q).sum(-1).mean()))
    return {"held_out_draft_loss": float(loss), "held_out_top1_by_position": [round(v, 4) for v in top1],
            "held_out_acceptance_t07_by_position": [round(v, 4) for v in accept]}


def train_draft(method: str, step: torch.nn.Module, train: TargetData, held: TargetData, schedule: Schedule, *,
                seed: int, log: Callable[[str], None], name: str) -> dict[str, Any]:
    params = draft_parameters(step)
    gen = torch.Generator().manual_seed(seed)
    predict = predictions_for(method)

    def step_loss(_: int) -> torch.Tensor:
        rows = torch.randint(0, train.tokens.shape[0], (schedule.batch_size,), generator=gen)
        return draft_loss(predict(step, train, rows, num_anchors=schedule.anchors, gen=gen), train)

    step.drafter.train()
    with differentiable_ops():
        losses = train_loop(params, schedule, step_loss, log=log, name=name)
        step.drafter.eval()
        figures = {"train_loss_last_50": sum(losses[-50:]) / len(losses[-50:]), **accuracy(step, method, held, seed=seed)}
    log(f"{name}: held-out draft loss {figures['held_out_draft_loss']:.3f}, top-1 by position "
        f"{figures['held_out_top1_by_position']}, acceptance at T 0.7 {figures['held_out_acceptance_t07_by_position']}")
    return figures


STORAGE_DTYPE = torch.float16   # drafts are stored in half precision: the bundled models must fit in 30 MB


def save_draft(step: torch.nn.Module, draft: MemoryCheckpoint, adapt: Callable, out: Path) -> None:
    """Write the trained drafter back into checkpoint layout, floating tensors in STORAGE_DTYPE (the export
    casts them to the artifact's dtype; a draft's precision only moves acceptance, never the output)."""
    from export.tiny.common import save_checkpoint

    write_back = invert_adapter(adapt, dict(draft))
    tensors = {key: t.to(STORAGE_DTYPE) if t.is_floating_point() else t
               for key, t in write_back(step.drafter.state_dict()).items()}
    save_checkpoint(out, {**draft.config, "torch_dtype": str(STORAGE_DTYPE).removeprefix("torch.")}, tensors)


def finetune_mtp(target_dir: Path, sequences: tuple[torch.Tensor, torch.Tensor], schedule: Schedule, *, k: int,
                 seed: int, log: Callable[[str], None]) -> dict[str, float]:
    """After the joint run: the MTP layer, reused for K draft steps as method `mtp` runs it, trained further on
    the (now frozen) target's own outputs, and written back into the checkpoint's `model.layers.{L}`."""
    from export.train.targets import write_mtp_layer

    step = build_step("mtp", target_dir, None, k)
    train, held = (target_features(step.target, s) for s in sequences)
    figures = train_draft("mtp", step, train, held, schedule, seed=seed, log=log, name="deepseek-v3 mtp")
    write_mtp_layer(target_dir, step.drafter)
    return {f"mtp_{key}": value for key, value in figures.items()}
