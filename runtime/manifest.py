"""The artifact contract shared by export, engines and runtime: graph input/output names (DESIGN.md §3).

Owned by the runtime (it is what the runtime reads); `export` and `engines` import this module and
nothing else of `runtime` besides `runtime.errors`. Every name below is the exact ONNX value name.
"""

from __future__ import annotations

# --- inputs -------------------------------------------------------------------------------------------
TOKENS = "tokens"                        # int64 [S]
ROW_OFFSETS = "row_offsets"              # int64 [B+1]
POSITIONS = "positions"                  # int64 [S]
CACHE_LENGTHS = "cache_lengths"          # int64 [B]
BLOCK_TABLE = "block_table"              # int64 [B, max_blocks]
DRAFT_TOKENS = "draft_tokens"            # int64 [B, K]; -1 = no drafts for that row
KV_POOL = "kv_pool"                      # [num_blocks, L, block_size, W]
FULL_KV_POOL = "full_kv_pool"            # Gemma 4: full-attention layers' pool when head dims differ
DRAFT_KV_POOL = "draft_kv_pool"          # [num_blocks, Ld, block_size, Wd]
CHUNK_NEXT_TOKENS = "chunk_next_tokens"  # int64 [B]; -1 unless the row's prompt continues next step
TEMPERATURE = "temperature"              # f32 [B]
TOP_K = "top_k"                          # int64 [B]
TOP_P = "top_p"                          # f32 [B]
MIN_P = "min_p"                          # f32 [B]
NOISE = "noise"                          # f32 [B, K+1, C]
IN_THINKING_PHASE = "in_thinking_phase"  # bool [B]
TOKEN_BITMASK = "token_bitmask"          # int32 [B, K+1, ceil(V/32)] (structured-output artifacts only)

# --- outputs ------------------------------------------------------------------------------------------
NUM_ACCEPTED = "num_accepted"            # int64 [B]
NEXT_TOKENS = "next_tokens"              # int64 [B]
NEXT_DRAFT_TOKENS = "next_draft_tokens"  # int64 [B, K]
KV_DELTA = "kv_delta"                    # [S + B*K, L, W]
FULL_KV_DELTA = "full_kv_delta"          # [S + B*K, L_full, W_full] (Gemma 4)
DRAFT_KV_DELTA = "draft_kv_delta"        # [S + B*K, Ld, Wd]

# Each pool input and the delta output whose rows the runtime commits into it.
DELTA_OF_POOL = {KV_POOL: KV_DELTA, FULL_KV_POOL: FULL_KV_DELTA, DRAFT_KV_POOL: DRAFT_KV_DELTA}

SAMPLING_INPUTS = (TEMPERATURE, TOP_K, TOP_P, MIN_P, NOISE, IN_THINKING_PHASE)
