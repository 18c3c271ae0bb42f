"""The TensorRT side without TensorRT: modules import lazily, registration fails with a clear message, and
every kernel compiles to PTX exactly as aot_impl would (CPU only). With TensorRT and a GPU (markers trt, gpu):
each plugin is registered, built into an engine, run and compared with its reference, and an ONNX node
with plugin_namespace becomes the plugin even with its reference function attached."""

from __future__ import annotations

import importlib
import re

import pytest

import plugins.trt_common as trt_common
from tests.plugins.kernels.clean import run_clean


def test_trt_modules_import_without_tensorrt() -> None:
    modules = [importlib.import_module(name) for name in trt_common.PLUGIN_MODULES]
    assert [m.PLUGIN_ID for m in modules] == ["unispec::PagedAttention", "unispec::PagedMLA", "unispec::MoE",
                                              "unispec::SpecAccept"]
    if not trt_common.tensorrt_available():
        with pytest.raises(ImportError, match="tensorrt"):
            trt_common.register_all()


def test_aot_compile_refuses_interpreted_kernels() -> None:
    """Under TRITON_INTERPRET (set for this folder) kernels cannot be compiled: the error says so."""
    from plugins.spec_accept import trt

    spec = trt.kernel_spec("fp32", num_drafts=2, relaxed_top_n=10, relaxed_delta=0.6)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        trt_common.compile_kernel(spec)


def test_kernel_spec_signature_is_checked() -> None:
    from plugins.paged_mla import trt

    spec = trt.kernel_spec("fp16", num_heads=4, width=24, kv_lora_rank=16, scale=0.2)
    assert list(spec.signature)[-1] == "out_ptr" and spec.signature["past_slots"] == "i32"
    assert spec.constexprs["R"] == 16 and spec.constexprs["DR"] == 8 and spec.grid_y == 1


def test_plugins_register_and_compile_without_tensorrt() -> None:
    """Each plugin's register / autotune / aot_impl against a QDP stand-in (fake_tensorrt.py): inputs and
    attributes are the ONNX node's, output shapes follow, and aot_impl compiles its kernel (bf16, DeepSeek /
    Llama sizes, both tactics, sm_90 PTX) with a grid and int32 extra arguments fitting the kernel."""
    output = run_clean("from tests.plugins.kernels import qdp_check\nprint('\\n'.join(qdp_check.run_all()))\n")
    assert output.count("tactic") == 8 and "unispec::SpecAccept tactic 2: spec_accept_kernel" in output


def test_launcher_kernels_compile_to_ptx() -> None:
    """The kernels only the Python launchers use (pool variants, grouped MoE) compile for the GPU too."""
    output = run_clean("from tests.plugins.kernels import aot_check\n"
                       "for n, k in aot_check.compile_all().items(): print(n, k.num_ptx_params, k.shared)\n")
    assert "attention_pool" in output and "moe_combine" in output


@pytest.mark.slow
def test_plugin_kernels_compile_to_ptx_for_every_target_gpu() -> None:
    """What the plugins' aot_impl embed in an engine, as PTX for sm_80, sm_89, sm_90 and sm_120 (no GPU):
    compiled, not only interpreted, for every GPU the TensorRT flavours target (fp16; all types: below). Slow:
    ~5 minutes with Triton's cache empty; the fast suite compiles the sm_90 ones (test_plugins_register_...)."""
    output = run_clean("from tests.plugins.kernels import aot_check\n"
                       "for arch in aot_check.ARCHS:\n"
                       "    kernels = aot_check.compile_all(('fp16',), arch=arch, launchers=False)\n"
                       "    print(f'sm_{arch}: {len(kernels)} kernels')\n")
    assert re.findall(r"^sm_\d+: \d+ kernels$", output, re.M) == [
        "sm_80: 7 kernels", "sm_89: 7 kernels", "sm_90: 7 kernels", "sm_120: 7 kernels"]


@pytest.mark.slow
def test_plugin_kernels_compile_for_every_float_type_and_target() -> None:
    """fp32 / fp16 / bf16 plugin and launcher kernels for every target GPU; default tactics within 48 KB of
    shared memory (except fp32 MLA)."""
    run_clean("from tests.plugins.kernels import aot_check\n"
              "for arch in aot_check.ARCHS:\n"
              "    aot_check.compile_all(('fp32', 'fp16', 'bf16'), arch=arch)\n")


@pytest.mark.trt
@pytest.mark.gpu
def test_plugins_run_in_tensorrt() -> None:
    run_clean("from tests.plugins.kernels import trt_check\ntrt_check.run_all()\n")
