"""Pieces every trainer shares: token windows, the optimiser loop, differentiable op stand-ins, and the
inverse of a weight adapter (trained module parameters -> checkpoint tensors)."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugins.moe import reference as moe_reference
from plugins.paged_attention import reference as attention_reference
from plugins.paged_mla import reference as mla_reference


@dataclass(frozen=True, kw_only=True)
class Schedule:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int = 20
    weight_decay: float = 0.01
    anchors: int = 0          # drafts: anchor positions per batch

    def recipe(self) -> dict[str, float]:
        """The fields that shape training (`anchors` only where used, so target recipes keep their hash)."""
        return {k: v for k, v in vars(self).items() if k != "anchors" or v}


class Windows:
    """Random windows of `length` tokens from one token stream, from a seeded generator (same seed, same batches)."""

    def __init__(self, ids: torch.Tensor, length: int, seed: int) -> None:
        self.ids, self.length = ids, length
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> torch.Tensor:                                   # [size, length] int64
        starts = torch.randint(0, self.ids.numel() - self.length, (size,), generator=self.gen)
        return torch.stack([self.ids[s:s + self.length] for s in starts.tolist()])


def fixed_windows(ids: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows (held-out evaluation: no randomness at all)."""
    stride = max(1, (ids.numel() - length) // count)
    return torch.stack([ids[i * stride:i * stride + length] for i in range(count)])


def train_loop(params: list[torch.nn.Parameter], schedule: Schedule, loss_fn: Callable[[int], torch.Tensor],
               *, log: Callable[[str], None], name: str) -> list[float]:
    """AdamW with linear warmup then cosine decay to 10%; returns the loss of every step."""
    opt = torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=schedule.weight_decay)
    losses: list[float] = []
    for step in range(schedule.steps):
        lr = schedule.lr * _lr_factor(step, schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == schedule.steps - 1:
            log(f"{name}: step {step}/{schedule.steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f}")
    return losses


def _lr_factor(step: int, schedule: Schedule) -> float:
    if step < schedule.warmup:
        return (step + 1) / schedule.warmup
    progress = (step - schedule.warmup) / max(1, schedule.steps - schedule.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def batched_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, row_offsets: torch.Tensor, positions: torch.Tensor,
                            cache_lengths: torch.Tensor, *, scale: float, causal: bool = True,
                            sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """plugins.paged_attention.reference's semantics for batches whose rows all hold the same number of
    tokens (every training batch), as one masked SDPA per row instead of a copy of the cache per query:
    tens of times faster to train through. Anything else goes to the reference."""
    batch, (num_tokens, num_q_heads, head_dim) = row_offsets.numel() - 1, q.shape
    per_row = num_tokens // batch
    if softcap or num_tokens % batch or not torch.equal(row_offsets, torch.arange(batch + 1) * per_row):
        return attention_reference.paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths,
                                                   scale=scale, causal=causal, sliding_window=sliding_window)
    group, slots = num_q_heads // k.shape[1], k_cache.shape[1]
    keys = torch.cat([k_cache.float(), k.float().view(batch, per_row, *k.shape[1:])], dim=1)       # [B, P+r, Hkv, D]
    values = torch.cat([v_cache.float(), v.float().view(batch, per_row, *v.shape[1:])], dim=1)   # [B, P+r, Hkv, Dv]
    keys, values = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (keys, values))   # [B, Hq, P+r, *]
    pos = positions.view(batch, per_row)                                                        # [B, r]
    slot = torch.arange(slots)
    past_ok = (slot[None, None, :] < cache_lengths[:, None, None]).expand(batch, per_row, slots)  # [B, r, P]
    new_ok = torch.ones(batch, per_row, per_row, dtype=torch.bool)
    if causal:
        new_ok = pos[:, None, :] <= pos[:, :, None]                                             # [B, r, r]
    if sliding_window > 0:
        past_ok = past_ok & (pos[:, :, None] - slot[None, None, :] < sliding_window)
        new_ok = new_ok & (pos[:, :, None] - pos[:, None, :] < sliding_window)
    mask = torch.cat([past_ok, new_ok], dim=-1)[:, None]                                        # [B, 1, r, P+r]
    queries = q.float().view(batch, per_row, num_q_heads, head_dim).transpose(1, 2)             # [B, Hq, r, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)    # [B, Hq, r, Dv]
    return out.transpose(1, 2).reshape(num_tokens, num_q_heads, -1).to(q.dtype)


_OPS = {"paged_attention": batched_paged_attention, "paged_mla": mla_reference.paged_mla, "moe": moe_reference.moe}


@contextlib.contextmanager
def differentiable_ops() -> Iterator[None]:
    """The export modules call the custom ops (`unispec::paged_attention`, ...), which have no autograd
    formula; swap in their torch references (the ops' eager bodies, so the math is the same)."""
    from plugins.moe import op as moe_op
    from plugins.paged_attention import op as attention_op
    from plugins.paged_mla import op as mla_op

    custom = {"paged_attention": attention_op.paged_attention, "paged_mla": mla_op.paged_mla, "moe": moe_op.moe}
    custom["paged_attention_reference"] = attention_reference.paged_attention   # what paged_mla's reference calls
    swapped = [(module, name) for module in list(sys.modules.values())
               if getattr(module, "__name__", "").startswith(("export.archs", "plugins.paged_mla.reference"))
               for name, op in custom.items() if getattr(module, name.removesuffix("_reference"), None) is op]
    for module, name in swapped:
        setattr(module, name.removesuffix("_reference"), _OPS[name.removesuffix("_reference")])
    try:
        yield
    finally:
        for module, name in swapped:
            setattr(module, name.removesuffix("_reference"), custom[name])


def invert_adapter(adapt: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
                   template: Mapping[str, torch.Tensor]) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The inverse of a weight adapter that only renames, reshapes, slices and stacks (all of ours do).

    Every floating checkpoint element gets a unique id (exact in float64); adapting the ids tells where each
    module element came from. The returned function writes a trained module state back into a copy of
    `template`; integer tensors (vocabulary maps) are kept as they are.
    """
    ids, offset = {}, 0
    for key, tensor in template.items():
        if tensor.is_floating_point():
            ids[key] = torch.arange(offset, offset + tensor.numel(), dtype=torch.float64).reshape(tensor.shape)
            offset += tensor.numel()
        else:
            ids[key] = tensor
    traced = {k: t for k, t in adapt(ids).items() if t.is_floating_point()}
    keys = [k for k, t in template.items() if t.is_floating_point()]
    starts = torch.tensor([0, *[template[k].numel() for k in keys]]).cumsum(0)

    def write_back(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = torch.cat([template[k].detach().reshape(-1).double() for k in keys])
        for key, where in traced.items():
            flat[where.reshape(-1).long()] = state[key].detach().reshape(-1).double()
        out = dict(template)
        for i, key in enumerate(keys):
            out[key] = flat[starts[i]:starts[i + 1]].reshape(template[key].shape).to(template[key].dtype).clone()
        return out

    return write_back
