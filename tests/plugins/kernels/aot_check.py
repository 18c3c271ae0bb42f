"""Compile every Triton kernel to PTX as TensorRT's aot_impl would (no GPU, no TensorRT needed).

Run in a fresh process without TRITON_INTERPRET (test_kernels_aot.py). The plugin kernels go through each
op's `kernel_spec` (exactly what aot_impl compiles); the launcher-only kernels (pool variants, the grouped
MoE pipeline) get hand-written signatures, so code paths the interpreter never type-checks strictly
(tl.dot shapes, dtype promotion, constexpr branches) are compiled for the GPU too. ARCHS are the GPUs the
two TensorRT flavours target: A100 (sm_80), Ada (sm_89), Hopper (sm_90), Blackwell RTX (sm_120).
"""

from __future__ import annotations

from plugins.moe import kernels as moe_kernels
from plugins.moe import trt as moe_trt
from plugins.paged_attention import kernels as attention_kernels
from plugins.paged_attention import trt as attention_trt
from plugins.paged_mla import kernels as mla_kernels
from plugins.paged_mla import trt as mla_trt
from plugins.spec_accept import trt as accept_trt
from plugins.trt_common import CompiledKernel, KernelSpec, compile_kernel

ARCH = 90
ARCHS = (80, 89, 90, 120)
ROUTE = dict(num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)


def plugin_specs(dtypes: tuple[str, ...]) -> dict[str, KernelSpec]:
    """What the four plugins' aot_impl compile, at real model sizes, for the given float types."""
    specs = {}
    for dtype in dtypes:
        specs[f"attention_{dtype}"] = attention_trt.kernel_spec(
            dtype, num_q_heads=32, num_kv_heads=8, head_dim=128, v_dim=128, scale=0.088, causal=True,
            sliding_window=0, softcap=0.0, block_n=attention_trt.TACTICS[2])
        for tactic in mla_trt.TACTICS:
            specs[f"mla_{dtype}_tactic{tactic}"] = mla_trt.kernel_spec(
                dtype, num_heads=128, width=576, kv_lora_rank=512, scale=0.072, tactic=tactic)
        specs[f"moe_{dtype}"] = moe_trt.kernel_spec(dtype, "fp32", hidden=7168, inter=2048, num_experts=256,
                                                    **ROUTE)
        specs[f"spec_accept_{dtype}"] = accept_trt.kernel_spec(dtype, num_drafts=3, relaxed_top_n=10,
                                                               relaxed_delta=0.6)
    specs["attention_window_softcap"] = attention_trt.kernel_spec(
        "bf16", num_q_heads=16, num_kv_heads=8, head_dim=256, v_dim=256, scale=0.0625, causal=False,
        sliding_window=1024, softcap=50.0)
    specs["spec_accept_k0"] = accept_trt.kernel_spec("fp32", num_drafts=0, relaxed_top_n=10, relaxed_delta=0.6,
                                                     block_v=256)
    return specs


def launcher_specs() -> dict[str, KernelSpec]:
    """The kernels only the Python launchers use (GPU path), with their signatures written out."""
    pool = dict(num_rows="i32", block_size="i32", bt_stride="i32", pool_block_stride="i64",
                pool_slot_stride="i32")
    attention = attention_kernels.attention_meta(32, 8, 128, 128, scale=0.088, causal=True, sliding_window=0,
                                                 softcap=0.0)
    tensors = ["q_ptr", "k_ptr", "v_ptr", "k_pool_ptr", "v_pool_ptr"]
    ints = ["block_table_ptr", "row_offsets_ptr", "positions_ptr", "cache_lengths_ptr"]
    signature = {**{n: "*bf16" for n in tensors}, **{n: "*i64" for n in ints}, "out_ptr": "*bf16", **pool}
    specs = {"attention_pool": KernelSpec(fn=attention_kernels.paged_attention_pool_kernel, signature=signature,
                                          constexprs=attention)}
    mla_signature = {"q_ptr": "*bf16", "latent_new_ptr": "*bf16", "pool_ptr": "*bf16",
                     **{n: "*i64" for n in ints}, "out_ptr": "*bf16", **pool}
    specs["mla_pool"] = KernelSpec(fn=mla_kernels.paged_mla_pool_kernel, signature=mla_signature,
                                   constexprs=mla_kernels.mla_meta(128, 576, 512, 0.072), num_warps=8)
    specs.update(_moe_pipeline_specs())
    return specs


def _moe_pipeline_specs() -> dict[str, KernelSpec]:
    route = moe_kernels.route_meta(256, **ROUTE)
    tiles = dict(tile_expert_ptr="*i64", tile_start_ptr="*i64", tile_end_ptr="*i64")
    blocks = dict(BLOCK_M=16, BLOCK_I=64, BLOCK_H=64)
    return {
        "moe_route": KernelSpec(fn=moe_kernels.route_kernel, constexprs=route, signature=dict(
            x_ptr="*bf16", gate_ptr="*fp32", bias_ptr="*fp32", hidden="i32", ids_ptr="*i32", weights_ptr="*fp32")),
        "moe_up": KernelSpec(fn=moe_kernels.expert_up_kernel, constexprs=dict(blocks, TOPK=8), signature=dict(
            x_ptr="*bf16", w_gate_ptr="*bf16", w_up_ptr="*bf16", order_ptr="*i64", **tiles, act_ptr="*fp32",
            hidden="i32", inter="i32")),
        "moe_down": KernelSpec(fn=moe_kernels.expert_down_kernel, constexprs=blocks, signature=dict(
            act_ptr="*fp32", w_down_ptr="*bf16", weights_ptr="*fp32", order_ptr="*i64", **tiles, y_ptr="*fp32",
            hidden="i32", inter="i32")),
        "moe_combine": KernelSpec(fn=moe_kernels.combine_kernel, constexprs=dict(TOPK=8, BLOCK_H=64),
                                  signature=dict(y_ptr="*fp32", out_ptr="*bf16", hidden="i32")),
    }


def compile_all(dtypes: tuple[str, ...] = (), *, arch: int = ARCH, launchers: bool = True
                ) -> dict[str, CompiledKernel]:
    """Compile the plugin kernels for `dtypes` (and every launcher kernel) for sm_`arch`; a failure names
    the kernel."""
    compiled = {}
    for name, spec in {**plugin_specs(dtypes), **(launcher_specs() if launchers else {})}.items():
        try:
            compiled[name] = compile_kernel(spec, arch=arch)
        except Exception as error:  # noqa: BLE001  (re-raised with the kernel's name)
            raise AssertionError(f"{name} does not compile for sm_{arch}: {error}") from error
        kernel = compiled[name]
        # sm_90 and sm_120 kernels come out as sm_90a / sm_120a, which the prefix covers
        assert kernel.name == spec.fn.__name__ and f".target sm_{arch}" in kernel.ptx, name
        assert kernel.num_ptx_params >= len(spec.signature), (name, kernel.num_ptx_params)
    # The default plugin tactics stay within the 48 KB a launch may use without opting in to more.
    for name, kernel in compiled.items():
        if name.endswith(("bf16", "fp16", "tactic1")) and not name.startswith("mla_fp32"):
            assert kernel.shared <= 48 * 1024, (name, kernel.shared)
    return compiled


if __name__ == "__main__":
    for arch in ARCHS:
        for name, kernel in compile_all(("fp32", "fp16", "bf16"), arch=arch).items():
            print(f"sm_{arch} {name}: {kernel.name} warps={kernel.num_warps} shared={kernel.shared} "
                  f"ptx_params={kernel.num_ptx_params}")
