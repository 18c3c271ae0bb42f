"""Kernel tests run the Triton kernels in Triton's interpreter on CPU tensors (reference/feasibility.md §10).

`@triton.jit` picks the interpreter when it decorates a kernel, i.e. when plugins/<op>/kernels.py is
imported, so TRITON_INTERPRET must be set before that; pytest imports this conftest before the test modules
of this folder. It stays set for the rest of the session, so tests that need compiled kernels (gpu, trt,
AOT compilation) run them in a fresh process without it (tests/plugins/kernels/clean.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
