"""RTN quantization of the weights DeepSeek-V3's ops read (export/quantize_ops.py, issue 35): the MoE op's expert
stacks and MLA's absorbed up-projections are int4 codes behind a blocked DequantizeLinear, as checkpoint FP8 ones
are; an int4 DeepSeek artifact speculates losslessly against its own quantized target, greedy and sampled (χ²)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.onnx_files import PLUGIN_DOMAIN, external_info, is_external
from export.quantize import QuantizeSettings, dequantize_blocks, quantize_graph
from runtime import manifest as io
from runtime.errors import ExportError

INT4 = QuantizeSettings(bits=4, block_size=32)
E, INTER, H, HEADS = 4, 32, 64, 2            # experts, expert intermediate, hidden, MLA heads
SCOPES = "pkg.torch.onnx.name_scopes"
METHODS = ("mtp", "nextn", "eagle3")     # tests/runtime/artifacts.py METHOD_CASES on DeepSeek-V3
# the tiny DeepSeek-V3 with MLA dims every block size divides (its own kv_lora / nope / v are 16, below them)
MLA_32 = {"kv_lora_rank": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}
VOCAB, TARGET_LAYERS, TINY_MLA = 320, 3, (4, 32, 32)   # the tiny pairs' vocabulary, layers, W_UK / W_UV^T dims
PROMPTS = [[5, 17, 33, 64], [9, 8, 7, 6, 5, 4, 3], [100, 2]]
# χ²: N requests of 3 new tokens each way (seeds disjoint), Pearson homogeneity test per token position
SAMPLED = (0.7, 40, 0.9, 0.02)           # temperature, top_k, top_p, min_p
NUM_REQUESTS, P_THRESHOLD = 2000, 1e-4


def _weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _scoped(node: onnx.NodeProto, module: str) -> onnx.NodeProto:
    """The exporter's metadata: a node's module path, then its own name."""
    node.metadata_props.add(key=SCOPES, value=repr(["", module, f"{node.op_type.lower()}_0"]))
    return node


def _toy(expert_k: int = H, mla_k: int = 32, *, mla_scopes: tuple[str, str] = ("target.attn", "target.attn"),
         mla_names: tuple[str, str] = ("slice_1", "slice_2")) -> onnx.ModelProto:
    """x [S, H] -> unispec::MoE(router, bias, w_gate [E, I, K], w_up, w_down [E, H, I]) and q [HEADS, S, mla_k]
    -> MatMul(W) twice over two folded constants of equal bytes (a drafter unrolled), as the exporter writes
    them: named after no module, the readers' scopes in their metadata."""
    w_uk = _weights((HEADS, mla_k, 32), 5)
    tensors = {"target.mlp.gate.weight": _weights((E, expert_k), 1), "target.mlp.gate.bias": _weights((E,), 1),
               "target.mlp.experts.gate_proj": _weights((E, INTER, expert_k), 2),
               "target.mlp.experts.up_proj": _weights((E, INTER, expert_k), 3),
               "target.mlp.experts.down_proj": _weights((E, expert_k, INTER), 4),
               mla_names[0]: w_uk, mla_names[1]: w_uk.copy()}
    moe = helper.make_node("MoE", ["x", *list(tensors)[:5]], ["y"], domain=PLUGIN_DOMAIN, name="moe",
                           num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=1,
                           routed_scaling_factor=1.0, plugin_namespace=PLUGIN_DOMAIN, plugin_version="1")
    mla = [_scoped(helper.make_node("MatMul", ["q", name], [f"o{i}"], name=f"mla{i}"), scope)
           for i, (name, scope) in enumerate(zip(mla_names, mla_scopes))]
    graph = helper.make_graph(
        [moe, *mla], "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", expert_k]),
         helper.make_tensor_value_info("q", TensorProto.FLOAT, [HEADS, "S", mla_k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["S", expert_k]),
         *(helper.make_tensor_value_info(name, TensorProto.FLOAT, [HEADS, "S", 32]) for name in ("o0", "o1"))],
        [numpy_helper.from_array(array, name) for name, array in tensors.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(PLUGIN_DOMAIN, 1)],
                             ir_version=10)


def _dequantized(model: onnx.ModelProto, value: str) -> tuple[np.ndarray, onnx.NodeProto, np.ndarray]:
    """(the float weight a DQ output stands for, the DQ, its codes as int8) for the value an op reads."""
    tensors = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    dq = producers[value]
    assert dq.op_type == "DequantizeLinear", (value, dq.op_type)
    scales = dq.input[1]
    while scales not in tensors:                              # a later use's Identity
        scales = producers[scales].input[0]
    assert tensors[dq.input[0]].data_type == TensorProto.INT4
    codes = numpy_helper.to_array(tensors[dq.input[0]]).astype(np.int8)
    attrs = {a.name: a.i for a in dq.attribute}
    back = dequantize_blocks(codes, numpy_helper.to_array(tensors[scales]), block_size=attrs["block_size"],
                             axis=attrs["axis"])
    return back, dq, codes


def test_expert_stacks_and_batched_matmul_weights_become_int4_behind_blocked_dequantize() -> None:
    model = _toy()
    floats = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert quantize_graph(model, INT4) == 5                  # 3 expert stacks, 2 reads of the MLA constant
    onnx.checker.check_model(model, full_check=True)
    moe = next(n for n in model.graph.node if n.op_type == "MoE")
    for index, name in zip((3, 4, 5), ("gate_proj", "up_proj", "down_proj")):
        back, dq, codes = _dequantized(model, moe.input[index])
        weight = floats[f"target.mlp.experts.{name}"]
        assert codes.shape == weight.shape and {a.name: a.i for a in dq.attribute} == {"axis": -1, "block_size": 32}
        step = np.abs(weight).reshape(*weight.shape[:-1], -1, 32).max(-1, keepdims=True) / 7
        assert np.all(np.abs(back - weight).reshape(step.shape[:-1] + (32,)) <= step / 2 * (1 + 1e-6))
    for node in (n for n in model.graph.node if n.op_type == "MatMul"):
        back, dq, _ = _dequantized(model, node.input[1])
        assert {a.name: a.i for a in dq.attribute} == {"axis": -2, "block_size": 32}
        assert np.abs(back - floats["slice_1"]).max() < 0.25 * np.abs(floats["slice_1"]).max()
    names = {t.name for t in model.graph.initializer}
    assert not names & ({*floats} - {"target.mlp.gate.weight", "target.mlp.gate.bias"})   # no float copy left
    # equal folded constants: one set of codes, the second read's scales through an Identity of its own
    assert len([t for t in model.graph.initializer if t.data_type == TensorProto.INT4]) == 4
    assert [n.op_type for n in model.graph.node].count("Identity") == 1
    typed = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert all(typed[name] == TensorProto.FLOAT for name in moe.input[3:])   # plugin functions go by dtype


def test_a_quantized_batched_matmul_runs_on_onnx_runtime_as_numpy_says() -> None:
    import onnxruntime as ort

    model = _toy()
    del model.graph.node[0], model.graph.output[0]            # the MoE needs its plugin function to run
    quantize_graph(model, INT4)
    back, _, _ = _dequantized(model, model.graph.node[-1].input[1])
    q = _weights((HEADS, 5, 32), 9)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(["o0", "o1"], {"q": q, "x": _weights((5, H), 9)})
    for got in out:
        np.testing.assert_allclose(got, q @ back, rtol=1e-5, atol=1e-5)


def test_an_expert_k_the_block_does_not_divide_is_one_line_and_changes_nothing() -> None:
    model = _toy(expert_k=48)
    before = model.SerializeToString()
    with pytest.raises(ExportError, match=r"^--quant-block 32 does not divide K = 48 of "
                                          r"'target\.mlp\.experts\.gate_proj' \[4, 32, 48\]; use a block size"):
        quantize_graph(model, INT4)
    assert model.SerializeToString() == before


def test_a_batched_weight_whose_k_the_block_does_not_divide_stays_float_and_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _toy(mla_k=16)                                    # the tiny models' MLA: K = 16 < every block size
    with caplog.at_level(logging.INFO, logger="export.quantize_ops"):
        assert quantize_graph(model, INT4) == 3               # the experts only
    assert {"slice_1", "slice_2"} <= {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    assert "--quant-block 32 does not divide K of 2 batched MatMul weight(s)" in caplog.text


def test_folded_constants_follow_the_module_reading_them_under_draft_quantize() -> None:
    from export.quantization import quantize_passes

    def int4_sources(target: QuantizeSettings | None, draft: QuantizeSettings | None) -> set[str]:
        model = _toy(mla_scopes=("target.layers.0.self_attn", "drafter.block.self_attn"), mla_names=("slice_1", "slice_9"))
        model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(_weights((HEADS, 32, 32), 6), "slice_9"))
        for settings, only in quantize_passes(target, draft):
            quantize_graph(model, settings, only=only)
        return {t.name.removesuffix("_int4") for t in model.graph.initializer if t.data_type == TensorProto.INT4}

    experts = {f"target.mlp.experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert int4_sources(INT4, None) == experts | {"slice_1"}
    assert int4_sources(None, INT4) == {"slice_9"}
    assert int4_sources(INT4, INT4) == experts | {"slice_1", "slice_9"}


# --- tiny DeepSeek-V3 pairs exported int4 ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """method -> its tiny DeepSeek-V3 pair (MLA dims 32) exported int4, block 32; each exported once."""
    from export.tiny import targets
    from tests.export.test_quantized_export import _export

    made: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in made:
            with pytest.MonkeyPatch.context() as patch:
                for key, value in MLA_32.items():
                    patch.setitem(targets.DEEPSEEK_V3, key, value)
                made[method] = _export(f"deepseek-v3-{method}", tmp_path_factory.mktemp(method), quantize="int4",
                                       quant_block=32)
        return made[method]

    yield get


def _float_left(path: Path) -> dict[str, tuple[int, ...]]:
    """Float initializers over 1 KiB that are none of: an embedding (read by Gather alone), a norm or bias (1-D),
    the MoE router (its input 1: it picks the experts; DeepSeek's FP8 checkpoints keep it bf16 too), the
    lm_head (a vocabulary dim: float unless --quantize-lm-head) or a DQ's scales."""
    graph = onnx.load(str(path), load_external_data=False).graph
    readers: dict[str, set[tuple[str, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, set()).add((node.op_type, index))
    left = {}
    for tensor in graph.initializer:
        dims = tuple(tensor.dims)
        if tensor.data_type != TensorProto.FLOAT or 4 * int(np.prod(dims)) <= 1024 or len(dims) == 1:
            continue
        read = readers.get(tensor.name, set())
        ops = {op for op, _ in read}
        if ops == {"Gather"} or read == {("MoE", 1)} or VOCAB in dims:
            continue
        if ops <= {"DequantizeLinear", "Identity"} and tensor.name.endswith("_scale"):
            continue
        left[tensor.name] = dims
    return left


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_int4_deepseek_holds_every_expert_stack_and_mla_projection_as_int4_and_stays_lossless(
        method: str, int4_artifact) -> None:
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    out = int4_artifact(method)
    assert io.Manifest.load(out).quantization == INT4.manifest_entry()
    for name in (io.MODEL_NAME, "target_only.onnx"):
        left = _float_left(out / name)
        # eagle3's MLA drafter keeps the tiny dims: its W_UK / W_UV (K = 16) alone stay float
        assert all(dims[-2] % 32 and len(dims) == 3 for dims in left.values()) and (
            method == "eagle3" or not left), (name, left)
        graph = onnx.load(str(out / name), load_external_data=False).graph
        producers = {o: n for n in graph.node for o in n.output}
        moes = [n for n in graph.node if n.op_type == "MoE"]
        assert moes and all(producers[n.input[i]].op_type == "DequantizeLinear" for n in moes for i in (3, 4, 5))
        mla = [t for t in graph.initializer if t.data_type == TensorProto.INT4 and tuple(t.dims) == TINY_MLA]
        assert len(mla) >= 2 * TARGET_LAYERS, (name, [t.name for t in mla])              # W_UK, W_UV^T
    # the target's expert and MLA codes are model.onnx.data's bytes in target_only.onnx too: stored once
    only = onnx.load(str(out / "target_only.onnx"), load_external_data=False).graph
    stacked = [t for t in only.initializer if t.data_type == TensorProto.INT4 and len(t.dims) == 3]
    assert stacked and all(is_external(t) and external_info(t)[0] == io.WEIGHTS_NAME for t in stacked)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    speculative = LLM(out, num_blocks=64, speculation="always").generate(PROMPTS, greedy)
    target_only = LLM(out, num_blocks=64, speculation="never").generate(PROMPTS, greedy)
    assert [o.token_ids for o in speculative] == [o.token_ids for o in target_only]


def _sampled(artifact: Path, speculation: str, first_seed: int) -> np.ndarray:
    """[NUM_REQUESTS, 3] tokens after one prompt, each request seeded on its own."""
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    t, k, p, m = SAMPLED
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=first_seed + i, max_tokens=3,
                             ignore_eos=True) for i in range(NUM_REQUESTS)]
    outputs = LLM(artifact, num_threads=1, speculation=speculation).generate([[5, 17, 3, 99, 42, 8]] * NUM_REQUESTS,
                                                                            params)
    return np.array([o.token_ids for o in outputs])


def homogeneity_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson χ² p-value that token samples `a` and `b` come from one distribution (a 2 x bins contingency
    table, bins whose expected count is under 5 pooled; the regularized gamma as test_distribution's)."""
    tokens = np.union1d(a, b)
    counts = np.stack([(a[:, None] == tokens).sum(0), (b[:, None] == tokens).sum(0)]).astype(np.float64)  # [2, T]
    share = counts.sum(0) / counts.sum()                                                                  # [T]
    small = share * min(len(a), len(b)) < 5
    if small.any():
        counts = np.concatenate([counts[:, ~small], counts[:, small].sum(1, keepdims=True)], axis=1)
    expected = counts.sum(1, keepdims=True) * counts.sum(0) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    assert dof >= 1, "one token only: nothing to test"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def test_the_homogeneity_test_tells_two_distributions_apart() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(30))
    same = homogeneity_pvalue(rng.choice(30, NUM_REQUESTS, p=p), rng.choice(30, NUM_REQUESTS, p=p))
    shifted = homogeneity_pvalue(rng.choice(30, NUM_REQUESTS, p=p), rng.choice(30, NUM_REQUESTS, p=p ** 1.3 / (p ** 1.3).sum()))
    assert same > P_THRESHOLD > shifted


@pytest.mark.slow
def test_int4_mtp_sampled_speculation_follows_the_quantized_targets_distribution(int4_artifact) -> None:
    """The target-only graph of the same artifact samples the quantized target itself: speculative tokens at
    each position must be indistinguishable from its (p > 1e-4, NUM_REQUESTS each way, disjoint seeds)."""
    out = int4_artifact("mtp")
    speculative, target_only = _sampled(out, "always", 10_000), _sampled(out, "never", 50_000)
    for position in range(3):
        pvalue = homogeneity_pvalue(speculative[:, position], target_only[:, position])
        assert pvalue > P_THRESHOLD, f"token {position + 1}: p = {pvalue:.2e}"
