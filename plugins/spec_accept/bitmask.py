"""Packed token bitmasks for structured output: unpack, apply to target logits, pack.

Layout (xgrammar's, little-endian within a word): int32 words `[..., ceil(V/32)]`; bit j of word w
(value `1 << j`, bit 31 being the sign bit) allows token `32*w + j`. A word of -1 allows all 32 tokens.
The runtime fills row i of `token_bitmask [B, K+1, W]` with the grammar state after i drafts; row K is
the bonus position (DESIGN.md §3).

The mask is applied to the target logits of every verified position *before* truncation and
acceptance, so a forbidden draft has target probability 0 (always rejected) and the recovered and bonus
tokens are always allowed.

Unpacking is integer arithmetic (Mod and a comparison), not BitwiseAnd / BitShift: no TensorRT parses
Bitwise ops (DESIGN.md §8). It is exact: every value fits int64.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 32

__all__ = ["BITS_PER_WORD", "apply_bitmask", "bit_powers", "num_bitmask_words", "pack_bitmask", "unpack_bitmask"]


def num_bitmask_words(vocab_size: int) -> int:
    """Words per position: ceil(V / 32)."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def _bit_values(device: torch.device) -> torch.Tensor:
    # [32] int32: 1, 2, 4, ..., 2**30, -2**31, the signed value of each bit (pack_bitmask sums them)
    values = [1 << j for j in range(BITS_PER_WORD - 1)] + [-(1 << (BITS_PER_WORD - 1))]
    return torch.tensor(values, dtype=torch.int32, device=device)


def bit_powers(device: torch.device) -> torch.Tensor:
    """[32] int64: 2**j, the value of bit j of a word read as unsigned."""
    return torch.tensor([1 << j for j in range(BITS_PER_WORD)], dtype=torch.int64, device=device)


def unpack_bitmask(
    bitmask: torch.Tensor,  # [..., W] int32, W >= ceil(V/32)
    vocab_size: int | torch.SymInt,
    powers: torch.Tensor | None = None,   # bit_powers(); given by a caller tracing inside an If branch
) -> torch.Tensor:
    """Allowed tokens as booleans: [..., V].

    Bit j of a word is set iff (u mod 2**(j+1)) >= 2**j, u the word read as unsigned (word mod 2**32,
    in int64). Only Mod and a comparison: an integer Div would export through float (torch's trunc
    division does), which cannot hold 32-bit words exactly.
    """
    unsigned = bitmask.to(torch.int64).remainder(1 << BITS_PER_WORD)                  # [..., W] in [0, 2**32)
    powers = bit_powers(bitmask.device) if powers is None else powers                 # [32] 2**j
    low_bits = unsigned[..., None].remainder(powers * 2)                               # [..., W, 32]
    allowed = (low_bits >= powers).flatten(-2)                                         # [..., W*32]
    return allowed[..., :vocab_size]                                                   # [..., V]


def apply_bitmask(
    logits: torch.Tensor,   # [..., V]
    bitmask: torch.Tensor,  # [..., W] int32
    powers: torch.Tensor | None = None,   # bit_powers(), as unpack_bitmask
) -> torch.Tensor:
    """Forbidden tokens' logits set to -inf: [..., V].

    A position whose mask allows nothing is left unmasked: that is a grammar bug on the host, and
    masking every token would turn the whole step into NaNs instead of one unconstrained token.
    """
    allowed = unpack_bitmask(bitmask, logits.shape[-1], powers)              # [..., V]
    satisfiable = allowed.any(dim=-1, keepdim=True)                          # [..., 1]
    allowed = allowed | ~satisfiable
    return torch.where(allowed, logits, torch.full_like(logits, float("-inf")))


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_bitmask`: bool [..., V] -> int32 [..., ceil(V/32)] (hosts and tests)."""
    vocab_size = allowed.shape[-1]
    words = num_bitmask_words(vocab_size)
    padded = torch.zeros(*allowed.shape[:-1], words * BITS_PER_WORD, dtype=torch.int64,
                         device=allowed.device)
    padded[..., :vocab_size] = allowed.to(torch.int64)
    grouped = padded.reshape(*allowed.shape[:-1], words, BITS_PER_WORD)     # [..., W, 32]
    # Signed bit values sum to the word's two's-complement value, always within int32.
    return (grouped * _bit_values(allowed.device).to(torch.int64)).sum(-1).to(torch.int32)
