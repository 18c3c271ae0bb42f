"""Run each plugin's register / autotune / aot_impl against the QDP stand-in (fake_tensorrt.py), in a
fresh process without TRITON_INTERPRET: the plugin's inputs and attributes are the ONNX node's (names,
order, ONNX types), output shapes follow from input shapes, every autotune combination types every I/O,
and aot_impl returns a compiled kernel whose extra int32 arguments and grid fit the kernel's signature.
"""

from __future__ import annotations

import importlib
from typing import Any

from tests.plugins.kernels import fake_tensorrt as fake

F, I64 = fake.TYPES["BF16"], fake.TYPES["INT64"]

# plugin id -> (input shapes and types, attributes, output dims, grid_y of tactics 1 and 2, extra args)
CASES: dict[str, tuple[Any, ...]] = {
    "unispec::PagedAttention": (
        [(("S", 32, 128), F), (("S", 8, 128), F), (("S", 8, 128), F), (("B", "P", 8, 128), F),
         (("B", "P", 8, 128), F), (("B+1",), I64), (("S",), I64), (("B",), I64)],
        dict(scale=0.088, causal=1, sliding_window=0, softcap=0.0), [("S", 32, 128)], (8, 8), ["B", "P"]),
    "unispec::PagedMLA": (
        [(("S", 128, 576), F), (("S", 576), F), (("B", "P", 576), F), (("B+1",), I64), (("S",), I64),
         (("B",), I64)],
        dict(scale=0.072, kv_lora_rank=512), [("S", 128, 512)], (8, 2), ["B", "P"]),
    "unispec::MoE": (
        [(("S", 7168), F), ((256, 7168), fake.TYPES["FLOAT"]), ((256,), fake.TYPES["FLOAT"]),
         ((256, 2048, 7168), F), ((256, 2048, 7168), F), ((256, 7168, 2048), F)],
        dict(num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=1, routed_scaling_factor=2.5),
        [("S", 7168)], (56, 14), [7168, 2048]),
    "unispec::SpecAccept": (
        [(("B", 4, "V"), F), (("B", 3), I64), (("B",), fake.TYPES["FLOAT"]), (("B",), I64),
         (("B",), fake.TYPES["FLOAT"]), (("B",), fake.TYPES["FLOAT"]), (("B", 4, 3), fake.TYPES["FLOAT"]),
         (("B",), fake.TYPES["BOOL"]), (("B", 4, "W"), fake.TYPES["INT32"]), (("B", 3, "V"), fake.TYPES["FLOAT"])],
        dict(num_drafts=3, relaxed_top_n=10, relaxed_delta=0.6), [("B",), ("B",)], (1, 1), ["V", 3, "W"]),
}
ONNX_MODULES = {"unispec::PagedAttention": "plugins.paged_attention.onnx",
                "unispec::PagedMLA": "plugins.paged_mla.onnx", "unispec::MoE": "plugins.moe.onnx",
                "unispec::SpecAccept": "plugins.spec_accept.onnx"}


def check_matches_onnx_node(plugin_id: str) -> None:
    plugin, spec = fake.PLUGINS[plugin_id], importlib.import_module(ONNX_MODULES[plugin_id]).SPEC
    assert plugin["tensors"] == [port.name for port in spec.inputs], plugin_id
    onnx_types = {name: int if kind is bool else kind for name, kind in spec.attribute_types().items()}
    assert plugin["attributes"] == onnx_types, (plugin_id, plugin["attributes"], onnx_types)


def check_plugin(plugin_id: str) -> list[str]:
    inputs, attrs, out_dims, grid_y, extras = CASES[plugin_id]
    plugin = fake.PLUGINS[plugin_id]
    descs = [fake.TensorDesc(shape, dtype) for shape, dtype in inputs]
    outputs = plugin["register"](*descs, **attrs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert [o.dims() for o in outputs] == out_dims, (plugin_id, [o.dims() for o in outputs])
    for combination in plugin["autotune"](*descs, outputs):
        assert len(combination.io_types) == len(descs) + len(outputs) and None not in combination.io_types
        assert combination.tactic_list, "every combination offers tactics"
    report = []
    assert combination.tactic_list == [1, 2]
    for tactic, tactic_grid_y in zip(combination.tactic_list, grid_y):
        name, ptx, launch, args = plugin["aot_impl"](*descs, *attrs.values(), outputs, tactic)
        assert name.decode() in ptx.decode() and launch.block_x % 32 == 0, plugin_id
        assert launch.grid_x == descs[0].shape_expr[0] and launch.grid_y == tactic_grid_y, (plugin_id, tactic)
        assert [a.value for a in args] == extras, (plugin_id, [a.value for a in args])
        report.append(f"{plugin_id} tactic {tactic}: {name.decode()} shared={launch.shared_mem}")
    return report


def run_all() -> list[str]:
    fake.install()
    from plugins.trt_common import register_all

    assert register_all() == list(CASES)
    report = []
    for plugin_id in CASES:
        check_matches_onnx_node(plugin_id)
        report += check_plugin(plugin_id)
    return report
