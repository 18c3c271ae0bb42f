"""Every method exported in float16 loads and generates on ONNX Runtime, greedy and seeded sampled.

Issue 15: the float16 DeepSeek artifacts (mtp, nextn, eagle3) were refused at load because MoE's reference
function returned float32 (tests/plugins/test_reference_dtypes.py pins the cause), and no test had exported
any method in float16. The float16 mtp case is the structured-output artifact that the fast TensorRT-RTX
build uses too (tests/engines/tensorrt/test_trt_build.py, one export for both); the other methods are `slow`.
"""

from __future__ import annotations

import pytest

from runtime.llm import LLM
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX, METHOD_CASES

FAST = "mtp"
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
MAX_TOKENS = 8


def _methods() -> list:
    return [pytest.param(m, id=m, marks=[] if m == FAST else [pytest.mark.slow]) for m in METHOD_CASES]


@pytest.mark.parametrize("method", _methods())
def test_a_float16_artifact_generates_on_onnx_runtime(method: str, tiny_artifact_of) -> None:
    artifact = tiny_artifact_of(METHOD_CASES[method] + (JSON_SUFFIX if method == FAST else ""), "float16")
    manifest = Manifest.load(artifact)
    assert manifest.method == method and manifest.dtype == "float16"
    assert all(pool.dtype == "float16" for pool in manifest.pools)
    # 'always': seeded samples depend on which graph ran each step, which adaptive speculation picks by timing
    llm = LLM(artifact, num_threads=1, speculation="always")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
               for i in range(len(PROMPTS))]
    for params in (greedy, sampled):
        first, again = llm.generate(PROMPTS, params), llm.generate(PROMPTS, params)
        for output, repeat in zip(first, again):
            assert len(output.token_ids) == MAX_TOKENS
            assert all(0 <= t < manifest.vocab_size for t in output.token_ids)
            assert output.token_ids == repeat.token_ids         # greedy and seeded sampling reproduce
