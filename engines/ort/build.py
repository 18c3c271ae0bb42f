"""`engines.ort.build`: every portable graph of an artifact lowered for ONNX Runtime's CPU backend.

  manifest.json graphs ─▶ step.portable        model.onnx       ─lower_graph─▶ model.ort.onnx        step.ort
                          target_only.portable target_only.onnx ─lower_graph─▶ target_only.ort.onnx  target_only.ort

Each lowered graph references its portable graph's external weights files (nothing is copied), so an
artifact grows by the graph files only. `unispec export` runs this inside its staging directory (the
artifact appears complete or not at all); run on a finished artifact, every file is written under a
temporary name and renamed, the manifest last.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from plugins.onnx_optimizer import fast_rules

if TYPE_CHECKING:
    import onnx_ir as ir
from plugins.quiet import quiet_libraries
from runtime import manifest as io

__all__ = ["BACKEND", "build", "lower_graph", "lowered_name"]

BACKEND = "ort"                   # its name in runtime/backends BACKENDS and in the manifest's graph map
SUFFIX = ".ort.onnx"
# libraries whose notes while optimizing (onnx_ir's initializer deduplication, per If branch) need nothing done
_QUIET_LOGGERS = ("onnxscript", "onnx_ir", "onnx")
FOLDED_WEIGHT_ELEMENTS = 1 << 20   # see _not_from_weights


def build(artifact_dir: str | Path, recipe: object | None = None) -> list[str]:
    """Lower every portable graph the manifest names into its `.ort.onnx`, record them in the manifest's
    graph map; returns the file names written (the manifest last). `recipe` is taken for the signature every
    engines/<backend> build shares: the ORT lowering has no settings (each rewrite applies where it is exact)."""
    directory = Path(artifact_dir)
    manifest = io.Manifest.load(directory)
    lowered = {graph: lowered_name(files[io.PORTABLE]) for graph, files in manifest.graphs.items()}
    for graph, name in lowered.items():
        lower_graph(directory, name, source=manifest.graphs[graph][io.PORTABLE])
    graphs = {graph: {**files, BACKEND: lowered[graph]} for graph, files in manifest.graphs.items()}
    _replace(directory / io.MANIFEST_NAME,
             lambda tmp: tmp.write_text(dataclasses.replace(manifest, graphs=graphs).to_json() + "\n"))
    return [*lowered.values(), io.MANIFEST_NAME]


def lowered_name(portable: str) -> str:
    """model.onnx -> model.ort.onnx (the lowered graph sits beside its portable graph)."""
    return portable.removesuffix(".onnx") + SUFFIX


def lower_graph(directory: Path, name: str, source: str = io.MODEL_NAME) -> None:
    """`name` beside `source`: its custom-op functions inlined and the graph optimized (onnxscript), for ONNX
    Runtime. ORT would inline the functions itself but cannot fold their shape arithmetic once they are
    inlined; this removes ~10% of the nodes a step runs. SpecAccept's body is its lazy reference
    (plugins/spec_accept/reference.py: no unpacking of an all-allowed bitmask, no relaxed verdict when no
    row is thinking), or, for float32 logits, it and SampleDraft run native kernels, as does float32 MoE
    (native_ops.py).
    Attention that reads a float32 pool first becomes unispec's in-place CPU kernel (lowering.py), RoPE and
    a few reshaping round trips are fused (fusions.py), then each layer's RoPE, head reshapes, KV delta row and
    that attention become one node (attention_fusion.py), so do the log-probability outputs (logprobs.py)
    and the merge of a step's tokens with its drafts (merge.py),
    and the linear layers run unispec's packed GEMM
    (linear.py) or, quantized, MLAS's MatMulNBits (quant.py)."""
    import onnx
    import onnx_ir as ir
    import onnxscript.optimizer

    import plugins
    from engines.ort import attention_fusion, fusions, linear, logprobs, lowering, merge, native_ops, quant

    model = ir.load(directory / source)
    native_ops.lower(model)
    plugins.attach_ort_functions(model)
    lowering.lower(model, lowering.find_pool_reads(onnx.load(str(directory / source), load_external_data=False)))
    fusions.fuse(model)
    with _quiet(), fast_rules():
        onnxscript.optimizer.optimize_ir(model, should_fold=_not_from_weights)
    attention_fusion.fuse(model)    # a layer's RoPE, head views, delta row and attention: one node
    logprobs.fuse(model)            # the log-probability outputs: one node
    merge.fuse(model)               # the merge of a step's tokens with its drafts: one node
    quant.lower(model)          # DQ + MatMul that ONNX Runtime would not fuse into MatMulNBits itself
    linear.lower(model)
    fusions.drop_unread_statistics(model)
    _replace(directory / name, lambda tmp: ir.save(model, tmp))


def _not_from_weights(node: ir.Node) -> bool | None:
    """The optimizer folds nothing computed from a weight of FOLDED_WEIGHT_ELEMENTS or more: the lowered graph
    would hold a second copy of it inline (MoE's reference transposes every expert stack: 1.5 GB a graph for a
    61-layer bfloat16 DeepSeek-V3 shape), which ONNX Runtime computes once when it loads the graph anyway."""
    for value in node.inputs:
        tensor = value.const_value if value is not None and value.is_initializer() else None
        if tensor is not None and tensor.size >= FOLDED_WEIGHT_ELEMENTS:
            return False
    return None


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` a hidden sibling of `path`, then rename it over `path`: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _quiet() -> AbstractContextManager[None]:
    """The optimizer's libraries log errors only and show no warning (their notes need nothing done)."""
    return quiet_libraries(_QUIET_LOGGERS)
