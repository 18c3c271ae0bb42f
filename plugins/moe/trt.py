"""TensorRT plugin `unispec::MoE` (tensorrt.plugin QDP): output shape, formats, AOT Triton kernel.

The ONNX node's inputs and attributes (plugins/moe/onnx.py): x [S, H], gate_weight [E, H] and
e_score_correction_bias [E] (router type R), w_gate / w_up [E, I, H], w_down [E, H, I] (type T);
num_experts_per_tok INT, n_group INT, topk_group INT, norm_topk_prob INT (ONNX bool), routed_scaling_factor
FLOAT. Output [S, H] of x's type.

A QDP AOT plugin launches one kernel and gets no workspace, so the plugin runs
plugins/moe/kernels.py:moe_fused_kernel (route + the token's k experts per (token, H tile)), not the
expert-grouped pipeline of `kernels.moe`, which needs a sort and scratch buffers between kernels:
    kernel(x, gate_weight, bias, w_gate, w_up, w_down, hidden = H, inter = I, out)   grid (S, H tiles)
E, H, I and the routing attributes are baked in. No `from __future__ import annotations` (QDP).
"""

from plugins.trt_common import (
    FLOAT_COMBINATION,
    KernelSpec,
    aot_result,
    compile_kernel,
    static_dim,
    triton_type,
)

PLUGIN_ID = "unispec::MoE"
TACTICS = {1: 128, 2: 512}   # tactic -> BLOCK_HO, output columns per program


def kernel_spec(dtype: str, router_dtype: str, *, hidden: int, inter: int, num_experts: int,
                num_experts_per_tok: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                routed_scaling_factor: float, block_ho: int = 128) -> KernelSpec:
    """The fused kernel for expert type `dtype`, router type `router_dtype`, one attribute set."""
    from plugins.moe import kernels

    route = kernels.route_meta(num_experts, num_experts_per_tok=num_experts_per_tok, n_group=n_group,
                               topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                               routed_scaling_factor=routed_scaling_factor)
    meta = dict(kernels.fused_meta(hidden, inter, route), BLOCK_HO=kernels.pow2(min(hidden, block_ho)))
    signature = {"x_ptr": f"*{dtype}", "gate_ptr": f"*{router_dtype}", "bias_ptr": f"*{router_dtype}",
                 "w_gate_ptr": f"*{dtype}", "w_up_ptr": f"*{dtype}", "w_down_ptr": f"*{dtype}",
                 "hidden": "i32", "inter": "i32", "out_ptr": f"*{dtype}"}
    return KernelSpec(fn=kernels.moe_fused_kernel, signature=signature, constexprs=meta,
                      grid_y=-(-hidden // int(meta["BLOCK_HO"])))


def register() -> str:
    """Declare the plugin to TensorRT (imports tensorrt); returns its id."""
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _outputs(x: trtp.TensorDesc, gate_weight: trtp.TensorDesc, e_score_correction_bias: trtp.TensorDesc,
                 w_gate: trtp.TensorDesc, w_up: trtp.TensorDesc, w_down: trtp.TensorDesc,
                 num_experts_per_tok: int, n_group: int, topk_group: int, norm_topk_prob: int,
                 routed_scaling_factor: float) -> trtp.TensorDesc:
        return x.like()                                           # [S, H]

    @trtp.autotune(PLUGIN_ID)
    def _formats(x: trtp.TensorDesc, gate_weight: trtp.TensorDesc, e_score_correction_bias: trtp.TensorDesc,
                 w_gate: trtp.TensorDesc, w_up: trtp.TensorDesc, w_down: trtp.TensorDesc,
                 outputs: tuple[trtp.TensorDesc]) -> list[trtp.AutoTuneCombination]:
        # T for x, experts and output; the router pair R independently (DeepSeek keeps it in float32).
        combination = trtp.AutoTuneCombination()
        combination.pos([0, 3, 4, 5, 6], FLOAT_COMBINATION)
        combination.pos([1, 2], "FP32*FP16*BF16")
        combination.tactics(list(TACTICS))
        return [combination]

    @trtp.aot_impl(PLUGIN_ID)
    def _kernel(x: trtp.TensorDesc, gate_weight: trtp.TensorDesc, e_score_correction_bias: trtp.TensorDesc,
                w_gate: trtp.TensorDesc, w_up: trtp.TensorDesc, w_down: trtp.TensorDesc, num_experts_per_tok: int,
                n_group: int, topk_group: int, norm_topk_prob: int, routed_scaling_factor: float,
                outputs: tuple[trtp.TensorDesc], tactic: int
                ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        hidden, inter = static_dim(x, 1, "hidden size"), static_dim(w_gate, 1, "intermediate size")
        spec = kernel_spec(triton_type(x.dtype, pointer=False), triton_type(gate_weight.dtype, pointer=False),
                           hidden=hidden, inter=inter, num_experts=static_dim(w_gate, 0, "experts"),
                           num_experts_per_tok=num_experts_per_tok, n_group=n_group, topk_group=topk_group,
                           norm_topk_prob=bool(norm_topk_prob), routed_scaling_factor=routed_scaling_factor,
                           block_ho=TACTICS.get(tactic, 128))
        return aot_result(trtp, compile_kernel(spec), x.shape_expr[0], spec.grid_y, [hidden, inter])

    return PLUGIN_ID
