"""Unified speculative-decoding step modules: one `forward` per step, exactly the contract's I/O.

```
tokens, draft_tokens ─ merge ─▶ merged [S+BK] ─▶ target ─▶ logits [B,K+1,V], hidden, captured, kv_delta
                                                     │
        token_bitmask ─ mask ─▶ accept (noise, sampling params) ─▶ num_accepted [B], next_tokens [B]
                                                     │
        shift(corrected merged, next_tokens | chunk_next_tokens) ─▶ drafter ─▶ next_draft_tokens [B,K],
                                                                              draft_kv_delta
```
`TargetOnlyStep` (method `none`), `SequentialStep` (mtp, nextn, eagle3, eagle3-mha, gemma4-mtp: one draft
pass over the merged rows, then one token per further step) and `BlockStep` (dflash: materialize context
K/V, one non-causal block pass) share the same input names (runtime/manifest.py).
"""
