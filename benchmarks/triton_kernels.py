"""Time the plugins' Triton kernels on a CUDA GPU, beside the machine's own copy bandwidth and torch's fused
attention, at real model sizes (random values; speed does not depend on them).

    python benchmarks/triton_kernels.py --json out.json

- PagedAttention reading the pool in place (`paged_attention_pool`), Llama 3 8B heads (32 q / 8 kv, D 128,
  bfloat16, block size 16), 1 token (decode) and 8 tokens (verify) per row, against
  `scaled_dot_product_attention` over the same history already contiguous (which a paged engine would have to
  gather first) and against the time to read the history at the copy bandwidth measured in the same run.
- PagedMLA from the pool, DeepSeek-V3 sizes (128 heads, latent 512 + rope 64), same comparison to bandwidth.
- SpecAccept, batch 16, K 3, vocabulary 128k: greedy rows, and sampled rows (temperature 0.7, top-p 0.95),
  against the torch reference on the same GPU.

Times are medians of triton.testing.do_bench. Needs CUDA (not run in tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BLOCK_SIZE = 16


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))   # ms


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy: what the memory moves, so reading
    N bytes alone is taken to need N / this."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_bench(lambda: dst.copy_(src)) * 1e-3)


def _paged(batch: int, ctx: int, width: int, dtype: torch.dtype):
    """A pool of one layer whose blocks are shuffled across rows, and its block table."""
    per_row = -(-(ctx + 8) // BLOCK_SIZE)
    blocks = torch.randperm(batch * per_row + 1, device="cuda")[: batch * per_row]
    pool = torch.randn(batch * per_row + 1, BLOCK_SIZE, width, device="cuda", dtype=dtype)
    return pool, blocks.view(batch, per_row)


def _ragged(batch: int, new: int, ctx: int) -> tuple[torch.Tensor, ...]:
    offsets = torch.arange(batch + 1, device="cuda") * new
    positions = (ctx + torch.arange(new, device="cuda")).repeat(batch)
    return offsets, positions, torch.full((batch,), ctx, device="cuda")


def attention_rows(bandwidth: float) -> list[dict]:
    from plugins.paged_attention import kernels

    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    rows = []
    for batch in (1, 16, 64):
        for ctx in (1024, 4096):
            for new in (1, 8):
                pool, table = _paged(batch, ctx, 2 * hkv * d, dtype)
                q = torch.randn(batch * new, hq, d, device="cuda", dtype=dtype)
                k, v = (torch.randn(batch * new, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
                meta = _ragged(batch, new, ctx)
                ms = _bench(partial(kernels.paged_attention_pool, q, k, v, pool, table, *meta, scale=d ** -0.5))
                kc = torch.randn(batch, hkv, ctx + new, d, device="cuda", dtype=dtype)
                vc = torch.randn_like(kc)
                qs = q.view(batch, new, hq, d).transpose(1, 2)
                mask = torch.ones(new, ctx + new, dtype=torch.bool, device="cuda").tril(ctx)
                sdpa = _bench(partial(torch.nn.functional.scaled_dot_product_attention, qs, kc, vc,
                                      attn_mask=mask, enable_gqa=True))
                history = batch * ctx * 2 * hkv * d * 2
                rows.append(dict(op="paged_attention_pool", batch=batch, ctx=ctx, new_tokens=new, kernel_ms=ms,
                                 sdpa_contiguous_ms=sdpa, kernel_over_sdpa=ms / sdpa,
                                 read_at_copy_bandwidth_ms=history / bandwidth * 1e3,
                                 bandwidth_share=history / bandwidth * 1e3 / ms))
    return rows


def mla_rows(bandwidth: float) -> list[dict]:
    from plugins.paged_mla import kernels

    heads, rank, rope, dtype = 128, 512, 64, torch.bfloat16
    rows = []
    for batch in (1, 16, 64):
        for ctx in (1024, 4096):
            pool, table = _paged(batch, ctx, rank + rope, dtype)
            q = torch.randn(batch, heads, rank + rope, device="cuda", dtype=dtype)
            latent = torch.randn(batch, rank + rope, device="cuda", dtype=dtype)
            meta = _ragged(batch, 1, ctx)
            ms = _bench(partial(kernels.paged_mla_pool, q, latent, pool, table, *meta,
                                scale=(rank + rope) ** -0.5, kv_lora_rank=rank))
            history = batch * ctx * (rank + rope) * 2
            rows.append(dict(op="paged_mla_pool", batch=batch, ctx=ctx, new_tokens=1, kernel_ms=ms,
                             read_at_copy_bandwidth_ms=history / bandwidth * 1e3,
                             bandwidth_share=history / bandwidth * 1e3 / ms))
    return rows


def accept_rows() -> list[dict]:
    """Flat logits (randn * 3: a top-p 0.95 nucleus of thousands of tokens at T 0.7, past the kernel's 256
    candidates) and peaked ones (32 hot tokens per position, as an LLM's: the nucleus lies inside them)."""
    from plugins.spec_accept import kernels, reference

    batch, k, vocab = 16, 3, 128 * 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(batch, k + 1, vocab, device="cuda", generator=g) * 3
    peaked = torch.randn(batch, k + 1, vocab, device="cuda", generator=g) * 2
    hot = torch.randint(0, vocab, (batch, k + 1, 32), device="cuda", generator=g)
    peaked.scatter_add_(-1, hot, torch.rand(batch, k + 1, 32, device="cuda", generator=g) * 4 + 8)
    noise = torch.rand(batch, k + 1, 3, device="cuda", generator=g)
    ones = torch.ones(batch, device="cuda")
    rows = []
    for name, logits, temperature, top_k, top_p in (
            ("flat greedy", flat, 0.0, 0, 1.0), ("flat T0.7", flat, 0.7, 0, 1.0),
            ("flat T0.7 top-k 50", flat, 0.7, 50, 1.0), ("flat T0.7 top-p 0.95", flat, 0.7, 0, 0.95),
            ("peaked T0.7 top-p 0.95", peaked, 0.7, 0, 0.95),
            ("peaked T0.7 top-k 50 top-p 0.95", peaked, 0.7, 50, 0.95)):
        drafts = logits[:, :k].argmax(-1)
        args = (logits, drafts, ones * temperature, torch.full((batch,), top_k, device="cuda"),
                ones * top_p, ones * 0.0, noise, torch.zeros(batch, dtype=torch.bool, device="cuda"))
        attrs = dict(num_drafts=k, relaxed_top_n=0, relaxed_delta=0.0)
        got = kernels.spec_accept(*args, **attrs)
        want = reference.spec_accept(*args, None, None, **attrs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
        ms = _bench(partial(kernels.spec_accept, *args, **attrs))
        ref = _bench(partial(reference.spec_accept, *args, None, None, **attrs))
        rows.append(dict(op="spec_accept", rows=name, batch=batch, k=k, vocab=vocab, kernel_ms=ms,
                         torch_reference_ms=ref, kernel_over_reference=ms / ref))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import triton

    bandwidth = copy_bandwidth()
    rows = attention_rows(bandwidth) + mla_rows(bandwidth) + accept_rows()
    for row in rows:
        print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bandwidth_bytes_per_s=bandwidth, rows=rows)
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
