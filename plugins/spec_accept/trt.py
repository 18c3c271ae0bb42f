"""TensorRT plugin `unispec::SpecAccept` (tensorrt.plugin QDP): output shapes, formats, AOT Triton kernel.

The ONNX node's inputs and attributes (plugins/spec_accept/onnx.py): logits [B, K+1, V] (type T),
draft_tokens [B, K] int64, temperature / top_p / min_p [B] float32, top_k [B] int64, noise [B, K+1, C]
float32, in_thinking_phase [B] bool, token_bitmask [B, K+1, W] int32; num_drafts INT, relaxed_top_n INT,
relaxed_delta FLOAT. Outputs num_accepted [B] and next_tokens [B], int64.

A QDP plugin has a fixed input list, so the plugin takes all nine inputs; the step graphs always feed the
bitmask (an in-graph all-allowed one without structured output, which the kernel treats exactly like no mask).

Kernel: plugins/spec_accept/kernels.py:spec_accept_kernel (truncation + verdict, one program per row),
    kernel(9 inputs, vocab_size = V, num_channels = C, num_words = W, num_accepted, next_tokens)  grid (B,)
K, the relaxed attributes and the vocab tile are baked in. No `from __future__ import annotations` (QDP).
"""

from plugins.trt_common import FLOAT_COMBINATION, KernelSpec, aot_result, compile_kernel, triton_type

PLUGIN_ID = "unispec::SpecAccept"
TACTICS = {1: 1024, 2: 256}   # tactic -> BLOCK_V, vocab ids per pass
INPUT_TYPES = ("*i64", "*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*i1", "*i32")   # after logits


def kernel_spec(dtype: str, *, num_drafts: int, relaxed_top_n: int, relaxed_delta: float,
                block_v: int = 1024) -> KernelSpec:
    """The kernel for logits type `dtype` and one attribute set (no TensorRT)."""
    from plugins.spec_accept import kernels

    names = ("logits_ptr", "draft_tokens_ptr", "temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr",
             "noise_ptr", "thinking_ptr", "bitmask_ptr")
    signature = dict(zip(names, (f"*{dtype}", *INPUT_TYPES)))
    signature.update(vocab_size="i32", num_channels="i32", num_words="i32", num_accepted_ptr="*i64",
                     next_tokens_ptr="*i64")
    constexprs = dict(K=int(num_drafts), HAS_BITMASK=True, TOP_N=int(relaxed_top_n), DELTA=float(relaxed_delta),
                      BLOCK_V=block_v)
    return KernelSpec(fn=kernels.spec_accept_kernel, signature=signature, constexprs=constexprs)


def register() -> str:
    """Declare the plugin to TensorRT (imports tensorrt); returns its id."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _outputs(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                 top_k: trtp.TensorDesc, top_p: trtp.TensorDesc, min_p: trtp.TensorDesc, noise: trtp.TensorDesc,
                 in_thinking_phase: trtp.TensorDesc, token_bitmask: trtp.TensorDesc, num_drafts: int,
                 relaxed_top_n: int, relaxed_delta: float) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        batch = (logits.shape_expr[0],)
        return trtp.from_shape_expr(batch, dtype=trt.int64), trtp.from_shape_expr(batch, dtype=trt.int64)

    @trtp.autotune(PLUGIN_ID)
    def _formats(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                 top_k: trtp.TensorDesc, top_p: trtp.TensorDesc, min_p: trtp.TensorDesc, noise: trtp.TensorDesc,
                 in_thinking_phase: trtp.TensorDesc, token_bitmask: trtp.TensorDesc,
                 outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
        types = [FLOAT_COMBINATION, "INT64", "FP32", "INT64", "FP32", "FP32", "FP32", "BOOL", "INT32", "INT64",
                 "INT64"]
        return [trtp.AutoTuneCombination(", ".join(types), "LINEAR", list(TACTICS))]

    @trtp.aot_impl(PLUGIN_ID)
    def _kernel(logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, temperature: trtp.TensorDesc,
                top_k: trtp.TensorDesc, top_p: trtp.TensorDesc, min_p: trtp.TensorDesc, noise: trtp.TensorDesc,
                in_thinking_phase: trtp.TensorDesc, token_bitmask: trtp.TensorDesc, num_drafts: int,
                relaxed_top_n: int, relaxed_delta: float, outputs: tuple[trtp.TensorDesc], tactic: int
                ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        spec = kernel_spec(triton_type(logits.dtype, pointer=False), num_drafts=num_drafts,
                           relaxed_top_n=relaxed_top_n, relaxed_delta=relaxed_delta,
                           block_v=TACTICS.get(tactic, 1024))
        return aot_result(trtp, compile_kernel(spec), logits.shape_expr[0], 1,
                          [logits.shape_expr[2], noise.shape_expr[2], token_bitmask.shape_expr[2]])

    return PLUGIN_ID
