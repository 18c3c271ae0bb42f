"""Speculative math shared by the torch reference and the exported graphs (DESIGN.md §3, §5).

- `ragged`: merge drafts into the ragged batch, shift corrected tokens, find the last accepted position;
- `truncation`: temperature -> top-k -> top-p -> min-p per row, inverse-CDF sampling with given noise;
- `bitmask`: packed int32 grammar masks applied to the target logits;
- `acceptance`: `verify` (greedy / sample-and-match / rejection / relaxed) and `sample_draft`.
Randomness is always an input (`noise [B, K+1, NOISE_CHANNELS]`), drawn on the host by runtime/noise.py.
"""

from export.spec.acceptance import (
    NOISE_CHANNELS,
    NOISE_DRAFT,
    NOISE_RESIDUAL,
    NOISE_TARGET,
    RELAXED_DELTA,
    RELAXED_TOP_N,
    count_accepted,
    rejection_verdict,
    relaxed_verdict,
    sample_draft,
    verify,
)
from export.spec.bitmask import apply_bitmask, num_bitmask_words, pack_bitmask, unpack_bitmask
from export.spec.ragged import (
    PLACEHOLDER_DRAFT,
    gather_last_accepted,
    last_accepted_index,
    merge_drafts,
    merge_positions,
    shift_tokens,
)
from export.spec.truncation import GREEDY_TEMPERATURE, is_greedy, sample_inverse_cdf, truncated_probs

__all__ = [
    "GREEDY_TEMPERATURE", "NOISE_CHANNELS", "NOISE_DRAFT", "NOISE_RESIDUAL", "NOISE_TARGET",
    "PLACEHOLDER_DRAFT", "RELAXED_DELTA", "RELAXED_TOP_N", "apply_bitmask", "count_accepted",
    "gather_last_accepted", "is_greedy", "last_accepted_index", "merge_drafts", "merge_positions",
    "num_bitmask_words", "pack_bitmask", "rejection_verdict", "relaxed_verdict", "sample_draft",
    "sample_inverse_cdf", "shift_tokens", "truncated_probs", "unpack_bitmask", "verify",
]
