"""TensorRT plugin `unispec::PagedAttention` (tensorrt.plugin QDP): output shape, formats, AOT Triton kernel.

The ONNX node's inputs and attributes (plugins/paged_attention/onnx.py) are the plugin's: q, k, v, k_cache,
v_cache, row_offsets, positions, cache_lengths; scale FLOAT, causal INT (ONNX has no bool attribute),
sliding_window INT, softcap FLOAT. Output [S, Hq, Dv] of q's type.

The kernel is plugins/paged_attention/kernels.py:paged_attention_kernel, launched as
    kernel(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths,   # inputs, contiguous
           num_rows = B, past_slots = P,                                       # int32 extra args
           out)                                                                # output
on grid (S, Hkv x query-head tiles). Head counts and head widths are baked in (static in the network);
S, B and P stay dynamic. Tactics pick the key tile (BLOCK_N). No `from __future__ import annotations`:
QDP reads the decorated functions' annotations as classes.
"""

from plugins.trt_common import (
    FLOAT_COMBINATION,
    KernelSpec,
    aot_result,
    compile_kernel,
    static_dim,
    triton_type,
)

PLUGIN_ID = "unispec::PagedAttention"
TACTICS = {1: 16, 2: 32}   # tactic -> BLOCK_N (64 would need 143 KB of shared memory in fp32)


def kernel_spec(dtype: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int, v_dim: int, scale: float,
                causal: bool, sliding_window: int, softcap: float, block_n: int = 16) -> KernelSpec:
    """The kernel for float type `dtype` ("fp32", "fp16", "bf16") and one attribute set (no TensorRT)."""
    from plugins.paged_attention import kernels

    meta = kernels.attention_meta(num_q_heads, num_kv_heads, head_dim, v_dim, scale=scale, causal=causal,
                                  sliding_window=sliding_window, softcap=softcap, block_n=block_n)
    floats = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    ints = {name: "*i64" for name in ("row_offsets_ptr", "positions_ptr", "cache_lengths_ptr")}
    signature = {**floats, **ints, "num_rows": "i32", "past_slots": "i32", "out_ptr": f"*{dtype}"}
    return KernelSpec(fn=kernels.paged_attention_kernel, signature=signature, constexprs=meta,
                      grid_y=kernels.head_programs(meta))


def register() -> str:
    """Declare the plugin to TensorRT (imports tensorrt); returns its id."""
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _outputs(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                 v_cache: trtp.TensorDesc, row_offsets: trtp.TensorDesc, positions: trtp.TensorDesc,
                 cache_lengths: trtp.TensorDesc, scale: float, causal: int, sliding_window: int,
                 softcap: float) -> trtp.TensorDesc:
        # A fresh descriptor: a like() copy may share its shape expressions with q.
        return trtp.from_shape_expr((q.shape_expr[0], q.shape_expr[1], v.shape_expr[2]), dtype=q.dtype)

    @trtp.autotune(PLUGIN_ID)
    def _formats(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                 v_cache: trtp.TensorDesc, row_offsets: trtp.TensorDesc, positions: trtp.TensorDesc,
                 cache_lengths: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc]
                 ) -> list[trtp.AutoTuneCombination]:
        types = ", ".join([FLOAT_COMBINATION] * 5 + ["INT64"] * 3 + [FLOAT_COMBINATION])
        return [trtp.AutoTuneCombination(types, "LINEAR", list(TACTICS))]

    @trtp.aot_impl(PLUGIN_ID)
    def _kernel(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                v_cache: trtp.TensorDesc, row_offsets: trtp.TensorDesc, positions: trtp.TensorDesc,
                cache_lengths: trtp.TensorDesc, scale: float, causal: int, sliding_window: int, softcap: float,
                outputs: tuple[trtp.TensorDesc], tactic: int
                ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        spec = kernel_spec(triton_type(q.dtype, pointer=False), num_q_heads=static_dim(q, 1, "q heads"),
                           num_kv_heads=static_dim(k, 1, "k heads"), head_dim=static_dim(q, 2, "q head_dim"),
                           v_dim=static_dim(v, 2, "v head_dim"), scale=scale, causal=bool(causal),
                           sliding_window=sliding_window, softcap=softcap, block_n=TACTICS.get(tactic, 16))
        return aot_result(trtp, compile_kernel(spec), q.shape_expr[0], spec.grid_y,
                          [k_cache.shape_expr[0], k_cache.shape_expr[1]])

    return PLUGIN_ID
