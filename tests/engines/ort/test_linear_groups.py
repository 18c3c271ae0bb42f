"""engines/ort/linear.py's grouping: PackedLinears of one X become one node (q, k, v -> one three-output node;
gate, Sigmoid, Mul, up, Mul -> one swiglu node), look-alikes keep their nodes, the graph computes what it did;
on a real bundled artifact the node count drops by 6 per layer and the step outputs match, with the groups
native and with every group put back as ONNX ops (plugins/ort_cpu/choice.py)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from engines.ort import linear as ort_linear
from plugins.ort_cpu import choice
from tests.engines.ort.test_linear import run, weight

K = 16


def layer_graph() -> onnx.ModelProto:
    """q, k, v of x; a SwiGLU MLP of h (gate written Mul(Sigmoid(g), g)); two look-alikes: a SwiGLU whose silu
    is also an output, and linears of another X of another K."""
    nodes = [helper.make_node("MatMul", ["x", f"w_{p}"], [p]) for p in "qkv"]
    nodes += [helper.make_node("ReduceSum", ["v", "axes"], ["v_sum"], keepdims=1),
              helper.make_node("Add", ["q", "k"], ["qk"]), helper.make_node("Add", ["qk", "v_sum"], ["h"])]
    for prefix, x in (("m", "h"), ("n", "x")):
        nodes += [helper.make_node("Gemm", [x, f"{prefix}_gate"], [f"{prefix}_g"], transB=1),
                  helper.make_node("Sigmoid", [f"{prefix}_g"], [f"{prefix}_sig"]),
                  helper.make_node("Mul", [f"{prefix}_sig", f"{prefix}_g"], [f"{prefix}_silu"]),
                  helper.make_node("Gemm", [x, f"{prefix}_up"], [f"{prefix}_u"], transB=1),
                  helper.make_node("Mul", [f"{prefix}_u", f"{prefix}_silu"], [f"{prefix}_out"])]
    nodes += [helper.make_node("MatMul", ["y", "w_a"], ["a"]), helper.make_node("MatMul", ["y", "w_b"], ["b"])]
    inits = [weight(f"w_{p}", (K, n)) for p, n in (("q", K), ("k", K), ("v", 8))]
    inits += [weight(f"{p}_{w}", (24, K)) for p in "mn" for w in ("gate", "up")]
    inits += [weight("w_a", (K + 4, 8)), weight("w_b", (K + 4, 8)), onnx.numpy_helper.from_array(np.array([1]), "axes")]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("m_out", "n_out", "n_silu", "a", "b")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", K]),
              helper.make_tensor_value_info("y", TensorProto.FLOAT, ["S", K + 4])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def test_siblings_and_swiglu_become_one_node_each_and_compute_the_same() -> None:
    before = layer_graph()
    model = ir.from_proto(before)
    assert ort_linear.lower(model) == 9
    after = ir.to_proto(model)
    linears = [n for n in after.graph.node if n.op_type == "PackedLinear"]
    shapes = sorted((len(n.input) - 1, len(n.output), {a.name: a.i for a in n.attribute}.get("swiglu", 0))
                    for n in linears)
    # m's gate|up fused; n's gate|up (its silu is read) two outputs, not with q|k|v of the same x (other layout)
    assert shapes == [(2, 1, 1), (2, 2, 0), (2, 2, 0), (3, 3, 0)]
    assert Counter(n.op_type for n in after.graph.node)["Sigmoid"] == 1      # only the look-alike's is left
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    onnx.checker.check_model(after)                                           # still topologically sorted
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, K)).astype(np.float32), "y": rng.standard_normal((3, K + 4)).astype(np.float32)}
    want, got = run(before, feeds), run(after, feeds)
    for name in want:
        # float32 sums alike (bit for bit in the linears); swiglu's exp is not MLAS's sigmoid: a few ulps apart
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6 * np.abs(want[name]).max(), err_msg=name)


def test_at_most_four_weights_share_a_node() -> None:
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(6)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", K])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(6)],
                              [weight(f"w{i}", (K, 8)) for i in range(6)])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10))
    assert ort_linear.lower(model) == 6
    assert sorted(len(n.inputs) - 1 for n in model.graph) == [2, 4]


@pytest.fixture(scope="module")
def artifacts(tiny_artifact_of, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama 3 (`none`) lowered twice: grouped (as exported now) and with grouping switched off."""
    from engines.ort import build  # engines/ort's build(): lowers every graph of an artifact

    source = tiny_artifact_of("llama3-none", "float32")
    made = {}
    for name in ("grouped", "single"):
        made[name] = tmp_path_factory.mktemp(name) / "artifact"
        shutil.copytree(source, made[name])
        with pytest.MonkeyPatch.context() as patch:
            if name == "single":
                patch.setattr(ort_linear, "group", lambda graph: 0)
            build(made[name])
    return made


def step_outputs(artifact: Path, table: choice.Choice, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """Greedy tokens and every step's float outputs, with `table` deciding which linears run native."""
    from runtime.backends.ort import OrtBackend
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    outputs: list[dict[str, np.ndarray]] = []
    run_step = OrtBackend.run
    monkeypatch.setattr(choice, "for_variant", lambda variant: table)

    def recorded(self: OrtBackend, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = run_step(self, feeds)
        outputs.append({k: v.copy() for k, v in result.items() if v.dtype == np.float32})
        return result

    monkeypatch.setattr(OrtBackend, "run", recorded)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [o.token_ids for o in LLM(artifact, num_blocks=64).generate([[5, 6, 7], [9, 3, 11, 4, 2]], greedy)]
    monkeypatch.undo()                          # the next call wraps the original run again
    return tokens, outputs


def test_a_bundled_graph_loses_six_nodes_a_layer_and_steps_alike(artifacts: dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {name: Counter(n.op_type for n in onnx.load(str(path / "model.ort.onnx"), load_external_data=False).graph.node)
              for name, path in artifacts.items()}
    layers = counts["single"]["Sigmoid"]
    assert layers > 0 and counts["grouped"]["Sigmoid"] == 0, counts
    assert counts["single"].total() - counts["grouped"].total() == 6 * layers       # q|k|v -2, gate/up MLP -4
    native = choice.Choice(max_rows=1 << 30)
    want_tokens, want = step_outputs(artifacts["single"], native, monkeypatch)
    for table in (native, choice.Choice()):                   # groups native; groups put back as ONNX ops
        tokens, got = step_outputs(artifacts["grouped"], table, monkeypatch)
        assert tokens == want_tokens and len(got) == len(want) > 0
        for step, expected in zip(got, want):
            for name, value in expected.items():
                np.testing.assert_allclose(step[name], value, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(value).max()))
