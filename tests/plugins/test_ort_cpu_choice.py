"""plugins/ort_cpu/choice.py and its hook in the ORT backend (issues 38/40): PackedLinears a variant does not run
go back to the ONNX ops the lowering replaced (MatMul, Gemm, MatMul over Transpose) with the same outputs; the
table is read for the variant the process runs, by weight size and rows per request; the backend opens the
rewritten graph from bytes with its weights still found beside the file, and a tiny artifact decodes the same
greedy tokens with every linear reverted as with every linear native."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugins import ort_cpu
from plugins.ort_cpu import choice
from runtime.backends import ort as ort_backend

RNG = np.random.default_rng(11)
BIG = 20_000                   # a [BIG, 16] float32 weight: 1.22 MiB, over the 1 MiB floor


def linears_model() -> onnx.ModelProto:
    """Three PackedLinears as the lowering writes them: MatMul's layout (x 2-D), Gemm's (x 2-D) and a head read
    through Transpose (x 3-D), plus one over a weight of more than 1 MiB."""
    w0, w1, w2 = (RNG.standard_normal(s).astype(np.float32) for s in ((16, 24), (16, 24), (40, 16)))
    big = RNG.standard_normal((BIG, 16)).astype(np.float32)
    nodes = [helper.make_node("PackedLinear", ["x", "w0"], ["a"], domain=ort_cpu.DOMAIN, trans_b=0, name="mm"),
             helper.make_node("PackedLinear", ["a", "w1"], ["b"], domain=ort_cpu.DOMAIN, trans_b=1, name="gemm"),
             helper.make_node("Unsqueeze", ["b", "axes"], ["b3"]),
             helper.make_node("PackedLinear", ["b3", "w2"], ["y"], domain=ort_cpu.DOMAIN, trans_b=1, name="head"),
             helper.make_node("PackedLinear", ["b", "big"], ["z"], domain=ort_cpu.DOMAIN, trans_b=1, name="big")]
    inits = [numpy_helper.from_array(w, n) for w, n in ((w0, "w0"), (w1, "w1"), (w2, "w2"), (big, "big"))]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axes"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", 40]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, ["M", BIG])], inits,
                              value_info=[helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", 24]),
                                          helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M", 16]),
                                          helper.make_tensor_value_info("b3", TensorProto.FLOAT, [1, "M", 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                             ir_version=10)


def op_types(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def run(model: onnx.ModelProto | bytes, x: np.ndarray, options: ort.SessionOptions | None = None) -> list[np.ndarray]:
    options = options or ort.SessionOptions()
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_reverted_linears_are_the_onnx_ops_with_the_same_outputs() -> None:
    native, reverted = linears_model(), onnx.ModelProto()
    reverted.CopyFrom(native)
    assert choice.revert_linears(reverted, choice.Choice(), rows=1) == 4
    assert op_types(reverted) == Counter({"MatMul": 2, "Gemm": 2, "Transpose": 1, "Unsqueeze": 1})
    gemm = next(n for n in reverted.graph.node if n.name == "gemm")
    assert gemm.op_type == "Gemm" and [(a.name, a.i) for a in gemm.attribute] == [("transB", 1)]
    x = RNG.standard_normal((5, 16)).astype(np.float32)
    for got, want in zip(run(reverted, x), run(native, x)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())   # float32 sums' rounding


@pytest.mark.parametrize(("variant", "rows", "kept"), [
    ("avx2", 1, set()), ("avx2", 4, set()), ("avx2", 7, set()), ("avx2", 8, {"big"}),
    ("avx512", 1, {"mm", "gemm", "head"}), ("avx512", 8, {"mm", "gemm", "head", "big"}), ("portable", 1, set()),
    ("portable", 4, set())])
def test_the_table_picks_by_variant_size_and_rows(variant: str, rows: int, kept: set[str]) -> None:
    model = linears_model()
    choice.revert_linears(model, choice.for_variant(variant), rows)
    assert {n.name for n in model.graph.node if n.op_type == "PackedLinear"} == kept


def test_the_backend_hook_reads_this_processes_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, model = tmp_path / "m.onnx", linears_model()
    x = RNG.standard_normal((3, 16)).astype(np.float32)
    want = run(model, x)
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data")  # small constants inline, as exported
    monkeypatch.setattr(ort_cpu, "isa", lambda: "avx512")
    assert ort_backend._kernels_for_isa(ort.SessionOptions(), path, rows=8) == str(path)    # nothing to put back
    for variant, rows, packed in (("avx512", 1, 3), ("avx2", 1, 0), ("avx2", 8, 1)):
        monkeypatch.setattr(ort_cpu, "isa", lambda variant=variant: variant)
        options = ort.SessionOptions()
        source = ort_backend._kernels_for_isa(options, path, rows=rows)
        assert isinstance(source, bytes)
        assert op_types(onnx.load_from_string(source))["PackedLinear"] == packed   # the small three, the big one, none
    for got, expected in zip(run(source, x, options), want):                         # weights read from tmp_path
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]  # nothing written


def test_an_artifact_decodes_the_same_tokens_with_linears_reverted(tiny_artifact_of,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    artifact = tiny_artifact_of("llama3-dflash", "float32")    # holds Gemm-, MatMul- and Transpose-read linears
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 3, 11, 4, 2]]
    revert, tokens, reverted = choice.revert_linears, {}, {}
    for name, table in (("native", choice.Choice(max_rows=1 << 30)), ("reverted", choice.Choice())):
        counts: list[int] = []
        monkeypatch.setattr(choice, "for_variant", lambda variant, table=table: table)
        monkeypatch.setattr(choice, "revert_linears", lambda *a, counts=counts: counts.append(revert(*a)) or counts[-1])
        tokens[name] = [o.token_ids for o in LLM(artifact, num_blocks=64).generate(prompts, greedy)]
        reverted[name] = sum(counts)
    assert reverted["native"] == 0 and reverted["reverted"] >= 30     # the graphs' PackedLinear nodes (groups count once)
    assert tokens["reverted"] == tokens["native"] and all(len(t) == 12 for t in tokens["native"])


def test_one_row_runs_nodes_up_to_the_byte_limit_native_grouped_weights_counted_together() -> None:
    """avx512's 1-row rule: a node of at most one_row_max_bytes stays PackedLinear, decided on all of a group's
    weights together (a q|k|v node is one stream), and a larger one goes back; 2+ rows keep both."""
    limit = choice.for_variant("avx512").one_row_max_bytes
    assert limit > 0
    widths = {"fits": limit // (4 * 16), "over": limit // (4 * 16) // 2 + 1}   # over: two such weights pass the limit
    nodes = [helper.make_node("PackedLinear", ["x", "fits_w"], ["fits"], domain=ort_cpu.DOMAIN, trans_b=1, name="fits"),
             helper.make_node("PackedLinear", ["x", "over_a", "over_b"], ["a", "b"], domain=ort_cpu.DOMAIN, trans_b=1,
                              name="over")]
    inits = [numpy_helper.from_array(np.zeros((widths[n[:4]], 16), np.float32), n) for n in ("fits_w", "over_a", "over_b")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 16])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["M", None]) for n in ("fits", "a", "b")],
                              inits)
    for rows, kept in ((1, {"fits"}), (2, {"fits", "over"})):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
        assert choice.revert_linears(model, choice.for_variant("avx512"), rows) == 2 - len(kept)
        assert {n.name for n in model.graph.node if n.op_type == "PackedLinear"} == kept
    assert "1 row for weights <= 1 MiB" in choice.describe("avx512")
