"""SpecAccept's constants, stated once: the torch reference (truncation.py, acceptance.py), its Triton kernels
(kernels.py), the native CPU kernels (plugins/ort_cpu writes them into the header it generates at build time)
and the runtime read them from here. No torch: a core install (no torch) builds the CPU kernels from it.

Noise `[B, K+1, NOISE_CHANNELS]` holds uniforms in [0, 1) from each request's own generator (runtime/noise.py);
acceptance.py's docstring says what each channel is drawn for.
"""

from __future__ import annotations

GREEDY_TEMPERATURE = 1e-5   # rows whose temperature is below it are decoded by argmax

NOISE_CHANNELS = 3
NOISE_TARGET = 0    # position i < K: y_i (sample-and-match) or the coin u_i (rejection); i = K: the bonus
NOISE_RESIDUAL = 1  # position i < K: the recovered token from the residual (rejection); unused at K
NOISE_DRAFT = 2     # position i < K: the sampled draft of in-graph draft step i (sampled drafts)

RELAXED_TOP_N = 10
RELAXED_DELTA = 0.6

__all__ = ["GREEDY_TEMPERATURE", "NOISE_CHANNELS", "NOISE_DRAFT", "NOISE_RESIDUAL", "NOISE_TARGET", "RELAXED_DELTA",
           "RELAXED_TOP_N"]
