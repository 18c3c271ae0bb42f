"""The PagedAttention reference against a plain per-token loop over an explicit key list."""

from __future__ import annotations

import math

import pytest
import torch

from plugins.paged_attention.reference import paged_attention
from plugins.ragged import row_ids_of


def _loop_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, *, scale, causal,
                    window, softcap):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(len(row_offsets) - 1):
        lo, hi = int(row_offsets[b]), int(row_offsets[b + 1])
        for s in range(lo, hi):
            t = int(positions[s])
            keys, vals = [], []
            for p in range(int(cache_lengths[b])):
                if window == 0 or t - p < window:
                    keys.append(k_cache[b, p]), vals.append(v_cache[b, p])
            for u in range(lo, hi):
                visible = (not causal) or int(positions[u]) <= t
                if visible and (window == 0 or t - int(positions[u]) < window):
                    keys.append(k[u]), vals.append(v[u])
            kk, vv = torch.stack(keys).double(), torch.stack(vals).double()          # [N, Hkv, D]
            for h in range(q.shape[1]):
                scores = kk[:, h // group] @ q[s, h].double() * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                out[s, h] = torch.softmax(scores, 0) @ vv[:, h // group]
    return out


@pytest.mark.parametrize("causal,window,softcap", [(True, 0, 0.0), (True, 5, 0.0), (False, 0, 0.0),
                                                    (True, 3, 30.0)])
def test_matches_loop(causal: bool, window: int, softcap: float) -> None:
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, dv, p = 4, 2, 8, 6, 12
    new_lens, cache_lens = [3, 1, 5], [4, 9, 0]
    row_offsets = torch.tensor([0, 3, 4, 9])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lens, new_lens)])
    s = int(row_offsets[-1])
    q, k = torch.randn(s, hq, d, generator=g), torch.randn(s, hkv, d, generator=g)
    v = torch.randn(s, hkv, dv, generator=g)
    k_cache, v_cache = torch.randn(3, p, hkv, d, generator=g), torch.randn(3, p, hkv, dv, generator=g)
    cache_lengths = torch.tensor(cache_lens)
    scale = 1 / math.sqrt(d)
    got = paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, scale=scale,
                          causal=causal, sliding_window=window, softcap=softcap)
    want = _loop_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, scale=scale,
                           causal=causal, window=window, softcap=softcap)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_stale_cache_slots_are_ignored() -> None:
    """Slots at or past cache_lengths hold garbage from other requests; they must not leak in."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 4, generator=g) for _ in range(3))
    k_cache, v_cache = torch.randn(1, 8, 2, 4, generator=g), torch.randn(1, 8, 2, 4, generator=g)
    args = (torch.tensor([0, 2]), torch.tensor([3, 4]), torch.tensor([3]))
    a = paged_attention(q, k, v, k_cache, v_cache, *args, scale=0.5)
    k_cache[:, 3:] = 1e4
    v_cache[:, 3:] = -1e4
    b = paged_attention(q, k, v, k_cache, v_cache, *args, scale=0.5)
    assert torch.equal(a, b)


def test_row_ids() -> None:
    assert row_ids_of(torch.tensor([0, 2, 2, 5]), 5).tolist() == [0, 0, 2, 2, 2]
