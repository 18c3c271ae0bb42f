"""TensorRT plugin `unispec::PagedMLA` (tensorrt.plugin QDP): output shape, formats, AOT Triton kernel.

The ONNX node's inputs and attributes (plugins/paged_mla/onnx.py): q [S, H, R+Dr], latent_new [S, R+Dr],
past [B, P, R+Dr], row_offsets, positions, cache_lengths; scale FLOAT, kv_lora_rank INT. Output [S, H, R].

Kernel: plugins/paged_mla/kernels.py:paged_mla_kernel, launched as
    kernel(q, latent_new, past, row_offsets, positions, cache_lengths, num_rows = B, past_slots = P, out)
on grid (S, head tiles). H, R and Dr are baked in. No `from __future__ import annotations` (QDP reads
annotations as classes).
"""

from plugins.trt_common import (
    FLOAT_COMBINATION,
    KernelSpec,
    aot_result,
    compile_kernel,
    static_dim,
    triton_type,
)

PLUGIN_ID = "unispec::PagedMLA"
# tactic -> (heads per program, latent rows per tile). 16 heads keep a bf16 program under 48 KB of shared
# memory (43 KB at R = 512, Dr = 64), the most a launch may use without opting in; 64 heads read the
# latent rows 4x less often but need 92 KB (whether TensorRT's AOT launch opts in is unverified).
TACTICS = {1: (16, 16), 2: (64, 16)}


def kernel_spec(dtype: str, *, num_heads: int, width: int, kv_lora_rank: int, scale: float,
                tactic: int = 1) -> KernelSpec:
    """The kernel for float type `dtype`, one attribute set and one tactic (no TensorRT)."""
    from plugins.paged_mla import kernels

    heads, block_n = TACTICS.get(tactic, TACTICS[1])
    meta = kernels.mla_meta(num_heads, width, kv_lora_rank, scale, block_n=block_n, heads_per_program=heads)
    signature = {"q_ptr": f"*{dtype}", "latent_new_ptr": f"*{dtype}", "past_ptr": f"*{dtype}",
                 "row_offsets_ptr": "*i64", "positions_ptr": "*i64", "cache_lengths_ptr": "*i64",
                 "num_rows": "i32", "past_slots": "i32", "out_ptr": f"*{dtype}"}
    return KernelSpec(fn=kernels.paged_mla_kernel, signature=signature, constexprs=meta,
                      grid_y=kernels.head_programs(meta), num_warps=8)


def register() -> str:
    """Declare the plugin to TensorRT (imports tensorrt); returns its id."""
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _outputs(q: trtp.TensorDesc, latent_new: trtp.TensorDesc, past: trtp.TensorDesc,
                 row_offsets: trtp.TensorDesc, positions: trtp.TensorDesc, cache_lengths: trtp.TensorDesc,
                 scale: float, kv_lora_rank: int) -> trtp.TensorDesc:
        return trtp.from_shape_expr((q.shape_expr[0], q.shape_expr[1], kv_lora_rank), dtype=q.dtype)  # [S, H, R]

    @trtp.autotune(PLUGIN_ID)
    def _formats(q: trtp.TensorDesc, latent_new: trtp.TensorDesc, past: trtp.TensorDesc,
                 row_offsets: trtp.TensorDesc, positions: trtp.TensorDesc, cache_lengths: trtp.TensorDesc,
                 outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
        types = ", ".join([FLOAT_COMBINATION] * 3 + ["INT64"] * 3 + [FLOAT_COMBINATION])
        return [trtp.AutoTuneCombination(types, "LINEAR", list(TACTICS))]

    @trtp.aot_impl(PLUGIN_ID)
    def _kernel(q: trtp.TensorDesc, latent_new: trtp.TensorDesc, past: trtp.TensorDesc,
                row_offsets: trtp.TensorDesc, positions: trtp.TensorDesc, cache_lengths: trtp.TensorDesc,
                scale: float, kv_lora_rank: int, outputs: tuple[trtp.TensorDesc], tactic: int
                ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        spec = kernel_spec(triton_type(q.dtype, pointer=False), num_heads=static_dim(q, 1, "q heads"),
                           width=static_dim(q, 2, "q width"), kv_lora_rank=kv_lora_rank, scale=scale,
                           tactic=tactic)
        return aot_result(trtp, compile_kernel(spec), q.shape_expr[0], spec.grid_y,
                          [past.shape_expr[0], past.shape_expr[1]])

    return PLUGIN_ID
