"""Kernel-vs-reference cases, shared by the interpreter tests (device "cpu") and GPU runs (device "cuda").

Every `check_*` builds its inputs on CPU from a fixed seed, runs the Triton launcher and the torch reference
on `device`, and raises AssertionError on a mismatch. `run_all(device)` runs every case (GPU subprocess).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from export.archs.common import gather_pool
from export.paged import PagedPools
from plugins.moe import reference as moe_reference
from plugins.paged_attention import reference as attention_reference
from plugins.paged_mla import reference as mla_reference
from plugins.spec_accept import reference as accept_reference
from plugins.spec_accept.bitmask import apply_bitmask, pack_bitmask
from plugins.spec_accept.truncation import is_greedy, sample_inverse_cdf, truncated_probs

ATOL = 1e-5
RELAXED = dict(relaxed_top_n=10, relaxed_delta=0.6)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
    diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    assert diff <= atol * max(1.0, want.float().abs().max().item()), f"{what}: max |diff| {diff:.3g}"


def ragged(rows: Sequence[tuple[int, int]], device: str) -> dict[str, torch.Tensor]:
    """row_offsets, positions, cache_lengths for rows given as (new tokens, cached tokens)."""
    new = torch.tensor([n for n, _ in rows])
    cached = torch.tensor([c for _, c in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(new, 0)])
    positions = torch.cat([c + torch.arange(n) for n, c in rows])
    return {"row_offsets": offsets.to(device), "positions": positions.to(device),
            "cache_lengths": cached.to(device)}


# ---------------------------------------------------------------- PagedAttention
# name -> (rows (new, cached), q heads, kv heads, head dim, v dim, attributes)
ATTENTION_CASES: dict[str, tuple[Any, ...]] = {
    # prefill (nothing cached), decode (1 token), verify (several) rows; GQA 3; D != Dv; padding past P
    "gqa_ragged_causal": ([(2, 4), (1, 0), (4, 6), (3, 9)], 6, 2, 5, 11, dict(scale=0.3)),
    "non_causal_block": ([(4, 5), (5, 0), (1, 2)], 4, 1, 8, 8, dict(scale=0.35, causal=False)),
    "sliding_window": ([(3, 21), (1, 30), (5, 2)], 4, 2, 16, 16, dict(scale=0.25, sliding_window=7)),
    "softcap": ([(2, 3), (3, 17)], 8, 4, 16, 16, dict(scale=0.25, softcap=5.0)),
    # MHA, past and new tokens each spanning several 16-wide tiles
    "mha_multi_tile": ([(19, 0), (2, 37)], 2, 2, 32, 32, dict(scale=0.18)),
}


def attention_inputs(name: str, device: str, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    rows, q_heads, kv_heads, head_dim, v_dim, attrs = ATTENTION_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    num_tokens, past = sum(n for n, _ in rows), max(c for _, c in rows) + 3   # slots past every length
    inputs = {
        "q": torch.randn(num_tokens, q_heads, head_dim, generator=g),
        "k": torch.randn(num_tokens, kv_heads, head_dim, generator=g),
        "v": torch.randn(num_tokens, kv_heads, v_dim, generator=g),
        "k_cache": torch.randn(len(rows), past, kv_heads, head_dim, generator=g),
        "v_cache": torch.randn(len(rows), past, kv_heads, v_dim, generator=g),
    }
    inputs = {key: x.to(device=device, dtype=dtype) for key, x in inputs.items()}
    return {**inputs, **ragged(rows, device)}, attrs


def check_attention(name: str, device: str, dtype: torch.dtype = torch.float32) -> None:
    from plugins.paged_attention import kernels

    inputs, attrs = attention_inputs(name, device, dtype)
    want = attention_reference.paged_attention(*inputs.values(), **attrs)
    got = kernels.paged_attention(*inputs.values(), **attrs)
    _close(got, want, TOLERANCE[dtype] * (10 if attrs.get("softcap") else 1), f"PagedAttention {name}")


def paged_rows(rows: Sequence[tuple[int, int]], num_layers: int, width: int, block_size: int,
               seed: int) -> tuple[PagedPools, torch.Tensor, torch.Tensor]:
    """A shuffled pool holding each row's cached tokens; (pools, block_table, cache_lengths)."""
    pools = PagedPools({"kv_pool": (num_layers, width)}, num_blocks=24, block_size=block_size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for row, (_, cached) in enumerate(rows):
        pools.add(row)
        pools.reserve(row, cached + 1)
        pools.commit([row], {"kv_pool": torch.randn(cached, num_layers, width, generator=g)}, [0], [cached])
    table = pools.block_table(range(len(rows)))
    jumps = (table[:, 1:] - table[:, :-1] != 1) & (table[:, 1:] != 0)
    assert jumps.any(), "the block table should be non-contiguous"
    return pools, table, pools.cache_lengths(range(len(rows)))


def check_attention_pool(device: str) -> None:
    """Pool + shuffled block table read by the kernel == reference on the gathered rows (layer 1 of 2)."""
    from plugins.paged_attention import kernels

    rows, kv_heads, head_dim, group = [(2, 11), (1, 0), (3, 17)], 2, 8, 2
    pools, table, lengths = paged_rows(rows, 2, 2 * kv_heads * head_dim, block_size=4, seed=3)
    pool = pools.pools["kv_pool"].to(device)                                          # [N, L, bs, W]
    meta = ragged(rows, device)
    assert torch.equal(meta["cache_lengths"].cpu(), lengths)
    g = torch.Generator().manual_seed(5)
    num_tokens = sum(n for n, _ in rows)
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=g).to(device)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(device) for _ in range(2))
    past = gather_pool(pool, table.to(device))[1]                                     # [B, P, W]
    k_cache, v_cache = (t.unflatten(-1, (kv_heads, head_dim)) for t in past.chunk(2, dim=-1))
    for attrs in (dict(scale=0.3), dict(scale=0.3, sliding_window=5, causal=False)):
        want = attention_reference.paged_attention(q, k, v, k_cache, v_cache, *meta.values(), **attrs)
        got = kernels.paged_attention_pool(q, k, v, pool[:, 1], table.to(device), *meta.values(), **attrs)
        _close(got, want, ATOL, f"PagedAttention pool {attrs}")


# ---------------------------------------------------------------- PagedMLA
# name -> (rows, heads, kv_lora_rank, rope width)
MLA_CASES: dict[str, tuple[Any, ...]] = {
    "small_ragged": ([(2, 4), (1, 0), (4, 6)], 6, 8, 4),
    "deepseek_dims": ([(2, 5), (1, 9)], 4, 512, 64),       # R = 512, Dr = 64: two key parts, no 1024 padding
    "many_heads_multi_tile": ([(3, 20), (17, 0)], 80, 16, 8),   # 80 heads: two head tiles per token
}


def mla_inputs(name: str, device: str, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    rows, heads, rank, rope = MLA_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    num_tokens, past = sum(n for n, _ in rows), max(c for _, c in rows) + 2
    inputs = {"q": torch.randn(num_tokens, heads, rank + rope, generator=g),
              "latent_new": torch.randn(num_tokens, rank + rope, generator=g),
              "past": torch.randn(len(rows), past, rank + rope, generator=g)}
    inputs = {key: x.to(device=device, dtype=dtype) for key, x in inputs.items()}
    return {**inputs, **ragged(rows, device)}, dict(scale=(rank + rope) ** -0.5, kv_lora_rank=rank)


def check_mla(name: str, device: str, dtype: torch.dtype = torch.float32) -> None:
    from plugins.paged_mla import kernels

    inputs, attrs = mla_inputs(name, device, dtype)
    want = mla_reference.paged_mla(*inputs.values(), **attrs)
    _close(kernels.paged_mla(*inputs.values(), **attrs), want, TOLERANCE[dtype], f"PagedMLA {name}")


def check_mla_pool(device: str) -> None:
    from plugins.paged_mla import kernels

    rows, heads, rank, rope = [(2, 9), (3, 14), (1, 0)], 3, 16, 8
    pools, table, _ = paged_rows(rows, 2, rank + rope, block_size=4, seed=7)
    pool = pools.pools["kv_pool"].to(device)
    meta = ragged(rows, device)
    g = torch.Generator().manual_seed(8)
    num_tokens = sum(n for n, _ in rows)
    q = torch.randn(num_tokens, heads, rank + rope, generator=g).to(device)
    latent_new = torch.randn(num_tokens, rank + rope, generator=g).to(device)
    attrs = dict(scale=0.2, kv_lora_rank=rank)
    want = mla_reference.paged_mla(q, latent_new, gather_pool(pool, table.to(device))[1], *meta.values(), **attrs)
    got = kernels.paged_mla_pool(q, latent_new, pool[:, 1], table.to(device), *meta.values(), **attrs)
    _close(got, want, ATOL, "PagedMLA pool")


# ---------------------------------------------------------------- MoE
# name -> (tokens, hidden, inter, experts, attributes, bias boost of experts 0 and 1)
MOE_CASES: dict[str, tuple[Any, ...]] = {
    "two_groups_norm": (5, 6, 7, 6, dict(num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
                                          routed_scaling_factor=2.5), 0.0),
    "three_groups_plain": (9, 20, 12, 9, dict(num_experts_per_tok=3, n_group=3, topk_group=2,
                                               norm_topk_prob=False, routed_scaling_factor=1.0), 0.0),
    # two popular experts: their runs span several 16-pair tiles; hidden/inter span several tiles
    "skewed_many_tiles": (24, 80, 72, 16, dict(num_experts_per_tok=4, n_group=4, topk_group=2,
                                                norm_topk_prob=True, routed_scaling_factor=1.5), 3.0),
}


FUSED_TOKENS = 6


def moe_inputs(name: str, device: str, dtype: torch.dtype = torch.float32) -> tuple[list, dict]:
    tokens, hidden, inter, experts, attrs, boost = MOE_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    bias = torch.randn(experts, generator=g) * 0.1
    bias[:2] += boost
    args = [torch.randn(tokens, hidden, generator=g), torch.randn(experts, hidden, generator=g) * 0.3, bias,
            torch.randn(experts, inter, hidden, generator=g) * 0.2,
            torch.randn(experts, inter, hidden, generator=g) * 0.2,
            torch.randn(experts, hidden, inter, generator=g) * 0.2]
    router = (1, 2)                          # gate_weight and bias stay float32, as DeepSeek keeps them
    return [a.to(device=device, dtype=torch.float32 if i in router else dtype) for i, a in enumerate(args)], attrs


def check_moe(name: str, device: str, dtype: torch.dtype = torch.float32) -> None:
    from plugins.moe import kernels

    args, attrs = moe_inputs(name, device, dtype)
    want = moe_reference.moe(*args, **attrs)
    _close(kernels.moe(*args, **attrs), want, TOLERANCE[dtype], f"MoE {name} grouped")
    # The fused kernel treats tokens independently (one program per token): a few suffice, and the
    # interpreter runs its per-token loops slowly.
    few = [args[0][:FUSED_TOKENS], *args[1:]]
    _close(kernels.moe_fused(*few, **attrs), want[:FUSED_TOKENS], TOLERANCE[dtype], f"MoE {name} fused")
    check_routing(args, attrs)


def check_routing(args: list, attrs: dict) -> None:
    """The routing kernel picks the reference's experts with the reference's weights."""
    from plugins.moe import kernels

    x, gate_weight, bias = args[:3]
    k = attrs["num_experts_per_tok"]
    ids = torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)
    weights = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
    meta = kernels.route_meta(gate_weight.shape[0], **attrs)
    kernels.route_kernel[(x.shape[0],)](x.contiguous(), gate_weight, bias, x.shape[1], ids, weights, **meta)
    dense = torch.zeros(x.shape[0], gate_weight.shape[0], device=x.device).scatter(1, ids.long(), weights)
    want = moe_reference.route(torch.nn.functional.linear(x.float(), gate_weight.float()), bias, **attrs)
    assert torch.equal(dense != 0, want != 0), "routing chose other experts"
    _close(dense, want, ATOL, "MoE routing weights")
    order, tile_expert, tile_start, tile_end = kernels.group_pairs(ids, gate_weight.shape[0], 16)
    assert torch.equal(ids.reshape(-1)[order].long().sort().values, ids.reshape(-1)[order].long())
    # Tile t covers sorted pairs [tile_start, min(tile_start + 16, tile_end)): every pair exactly once.
    covered = torch.clamp(tile_end - tile_start, max=16)
    assert (covered > 0).all() and int(covered.sum()) == ids.numel()


# ---------------------------------------------------------------- SpecAccept
# name -> (seed, rows, K, vocab, bitmask, integer logits (ties), logits dtype, vocab tile, edges)
# "edges": every row sampled from a flat distribution with a small top-k or a mid top-p, so samples often
# land on the last kept token: an off-by-one in a truncation threshold changes tokens.
ACCEPT_CASES: dict[str, tuple[Any, ...]] = {
    "k0_plain_decoding": (1, 12, 0, 64, False, False, torch.float32, 1024, False),
    "k1_masked": (2, 14, 1, 90, True, False, torch.float32, 1024, False),
    "k3": (3, 16, 3, 128, False, False, torch.float32, 1024, False),
    "k3_masked_ties": (4, 16, 3, 100, True, True, torch.float32, 1024, False),
    "k7": (5, 16, 7, 60, False, False, torch.float32, 1024, False),
    "k7_masked": (6, 14, 7, 77, True, False, torch.float32, 1024, False),
    "k4_fp16_ties": (7, 8, 4, 70, False, True, torch.float16, 1024, False),
    "k2_multi_tile": (8, 8, 2, 300, True, False, torch.float32, 64, False),    # vocab spans 5 tiles of 64
    "k3_truncation_edges": (9, 16, 3, 50, False, False, torch.float32, 1024, True),
    # flat rows over 10 tiles of 32: nuclei outgrow the kernel's 32 sorted candidates (its exact fallback)
    "k2_past_candidates": (10, 6, 2, 320, False, False, torch.float32, 32, True),
}


def accept_inputs(name: str, device: str) -> dict[str, torch.Tensor]:
    """Mixed rows: greedy / sampled with every filter on and off, thinking rows, -1 drafts, grammar masks.
    Drafts are mostly the reference's own candidates, so long accepted prefixes occur."""
    seed, rows, k, vocab, with_mask, ties, dtype, _, edges = ACCEPT_CASES[name]
    g = torch.Generator().manual_seed(seed)
    shape = (rows, k + 1, vocab)
    logits = torch.randint(-3, 3, shape, generator=g).float() if ties else torch.randn(shape, generator=g) * 2
    pick = lambda options: torch.tensor(options)[torch.randint(len(options), (rows,), generator=g)]  # noqa: E731
    greedy = torch.rand(rows, generator=g) < (0.0 if edges else 0.3)
    hot = 2.0 if edges else 0.4      # temperatures from hot to hot + 1.2
    inputs = {
        "logits": logits.to(dtype),
        "draft_tokens": torch.zeros(rows, k, dtype=torch.int64),
        "temperature": torch.where(greedy, 0.0, hot + 1.2 * torch.rand(rows, generator=g)),
        "top_k": pick([2, 3, 5, 0] if edges else [0, 1, 3, 10, vocab, vocab + 5, vocab // 2]),
        "top_p": pick([1.0, 0.6, 0.35] if edges else [1.0, 1.0, 0.95, 0.7, 0.3, 0.0]),
        "min_p": pick([0.0, 0.0, 0.1] if edges else [0.0, 0.0, 0.05, 0.2]),
        "noise": torch.rand(rows, k + 1, 3, generator=g),
        "in_thinking_phase": torch.rand(rows, generator=g) < 0.5,
    }
    if with_mask:
        allowed = torch.rand(shape, generator=g) < 0.7
        allowed[1, 0] = False                       # a position whose mask allows nothing: left unmasked
        inputs["token_bitmask"] = pack_bitmask(allowed)
    inputs["draft_tokens"] = drafts_for(inputs, g)
    return {key: x.to(device) for key, x in inputs.items()}


def drafts_for(inputs: dict[str, torch.Tensor], g: torch.Generator) -> torch.Tensor:
    """80% the reference's candidate, else one of the top-5 or any token; some -1 drafts."""
    logits, noise = inputs["logits"], inputs["noise"]
    rows, positions, vocab = logits.shape
    if inputs.get("token_bitmask") is not None:
        logits = apply_bitmask(logits, inputs["token_bitmask"])
    params = [inputs[key][:, None].expand(-1, positions) for key in ("temperature", "top_k", "top_p", "min_p")]
    sampled = sample_inverse_cdf(truncated_probs(logits, *params), noise[..., 0])
    candidates = torch.where(is_greedy(inputs["temperature"])[:, None], logits.argmax(-1), sampled)[:, :-1]
    top5 = logits[:, :-1].float().topk(min(5, vocab), dim=-1).indices
    near = top5.gather(-1, torch.randint(top5.shape[-1], (*candidates.shape, 1), generator=g))[..., 0]
    other = torch.where(torch.rand(candidates.shape, generator=g) < 0.5, near,
                        torch.randint(vocab, candidates.shape, generator=g))
    drafts = torch.where(torch.rand(candidates.shape, generator=g) < 0.8, candidates, other)
    drafts[0] = -1                        # a prefill row
    drafts[2, drafts.shape[1] // 2:] = -1   # drafts that stop early
    return drafts


def draft_probs_for(inputs: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    """q of sampled drafts [B, K, V] float32: near the target, a tenth of the tokens (drafts included) at 0."""
    g = torch.Generator().manual_seed(seed)
    logits = inputs["logits"][:, :-1].float().cpu()
    q = torch.softmax(logits + torch.randn(logits.shape, generator=g), dim=-1)
    return (q * (torch.rand(logits.shape, generator=g) > 0.1)).to(inputs["logits"].device)


def check_spec_accept(name: str, device: str, rejection: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel tokens == reference tokens for every row (with `rejection`, of drafts sampled from a q: the
    draft_probs input); returns the reference's (num_accepted, strict-only num_accepted) for coverage checks."""
    from plugins.spec_accept import kernels

    inputs = accept_inputs(name, device)
    args = [inputs[key] for key in ("logits", "draft_tokens", "temperature", "top_k", "top_p", "min_p", "noise",
                                    "in_thinking_phase")]
    bitmask, k = inputs.get("token_bitmask"), inputs["draft_tokens"].shape[1]
    probs = draft_probs_for(inputs, ACCEPT_CASES[name][0]) if rejection else None
    want = accept_reference.spec_accept(*args, bitmask, probs, num_drafts=k, **RELAXED)
    got = kernels.spec_accept(*args, bitmask, probs, num_drafts=k, **RELAXED, block_v=ACCEPT_CASES[name][7])
    for g, w, what in zip(got, want, ("num_accepted", "next_tokens")):
        assert torch.equal(g, w), f"SpecAccept {name} {what}: kernel {g.tolist()} reference {w.tolist()}"
    strict = accept_reference.spec_accept(*args, bitmask, probs, num_drafts=k, relaxed_top_n=0, relaxed_delta=0.0)
    return want[0].cpu(), strict[0].cpu()


def run_all(device: str, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> None:
    """Every case on `device` (the GPU runs; the interpreter tests parametrize over the same names)."""
    for dtype in dtypes:
        for name in ATTENTION_CASES:
            check_attention(name, device, dtype)
        for name in MLA_CASES:
            check_mla(name, device, dtype)
        for name in MOE_CASES:
            check_moe(name, device, dtype)
    check_attention_pool(device)
    check_mla_pool(device)
    for name in ACCEPT_CASES:
        check_spec_accept(name, device)
        check_spec_accept(name, device, rejection=True)
