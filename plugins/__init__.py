"""unispec custom ops, one folder per op (DESIGN.md §4). Imports nothing else of unispec.

Each `plugins/<op>/onnx.py` defines a `SPEC` (plugins/onnx_common.py: PluginSpec); this module lists them and
offers what export needs. Heavy libraries (torch, onnx, onnxscript) load on first use, not on import.

    table = plugins.custom_translation_table()    # registers the schemas too
    program = torch.onnx.export(..., dynamo=True, custom_translation_table=table)
    plugins.attach_functions_ir(program.model)     # reference functions, after export (the exporter inlines)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

    from plugins.onnx_common import PluginSpec

SPEC_MODULES = (
    "plugins.paged_attention.onnx",
    "plugins.paged_mla.onnx",
    "plugins.moe.onnx",
    "plugins.spec_accept.onnx",
    "plugins.spec_accept.draft_onnx",
)


def specs(*, ort: bool = False) -> dict[str, PluginSpec]:
    """op_type -> spec of every plugin; `ort`: a plugin's `ORT_SPEC` where it has one (a reference meant
    for ONNX Runtime graphs only, the same math with Ifs TensorRT cannot build)."""
    modules = [importlib.import_module(name) for name in SPEC_MODULES]
    found = [getattr(module, "ORT_SPEC", module.SPEC) if ort else module.SPEC for module in modules]
    return {spec.op_type: spec for spec in found}


def register_schemas() -> None:
    """Register every op's onnx.defs schema (idempotent); needed before export and before onnx.checker."""
    from plugins.onnx_common import register_schemas as register

    register(specs().values())


def custom_translation_table() -> dict[Any, Any]:
    """torch.onnx.export's `custom_translation_table`: each custom op -> its one-node onnxscript function."""
    register_schemas()
    return {spec.custom_op: spec.translation for spec in specs().values()}


def attach_functions_ir(model: ir.Model) -> ir.Model:
    """Attach the reference function of every unispec node of an exported onnx_ir model (in place)."""
    from plugins.onnx_common import attach_functions_ir as attach

    return attach(model, specs())


def attach_ort_functions(model: ir.Model) -> ir.Model:
    """Replace the reference functions of the unispec nodes that have an ONNX Runtime variant (in place):
    for model.ort.onnx, which only ONNX Runtime runs."""
    from plugins.onnx_common import attach_functions_ir as attach

    plain, ort = specs(), specs(ort=True)
    for key in [key for key in model.functions if key[0] == "unispec" and ort.get(key[1]) is not plain.get(key[1])]:
        del model.functions[key]
    return attach(model, ort)            # the others' functions are there already: kept


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Attach the reference function of every unispec node; returns a new ModelProto."""
    from plugins.onnx_common import attach_functions as attach

    return attach(model, specs())


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker.check_model(full_check=True) with the ops' schemas registered."""
    from plugins.onnx_common import check_model as check

    check(model, specs().values())
