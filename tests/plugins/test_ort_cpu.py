"""unispec.cpu::PagedAttentionPool, the native ONNX Runtime CPU kernel that reads the paged pool in place:
it equals the torch reference over each row's gathered past, reports bad feeds as errors, and its library
builds once per source and CPU (plugins/ort_cpu)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from export.archs.common import gather_pool, scatter_rows
from plugins import ort_cpu
from plugins.paged_attention.reference import paged_attention as reference

LAYERS, BLOCK = 3, 4
INPUTS = ("q", "k", "v", "kv_pool", "block_table", "row_offsets", "positions", "cache_lengths")
ROW_INPUTS = ("rows", "row_index")


def model(*, layer: int, k_column: int, v_column: int, scale: float, causal: int = 1, sliding_window: int = 0,
          softcap: float = 0.0, with_rows: bool = False) -> bytes:
    types = [TensorProto.FLOAT] * 4 + [TensorProto.INT64] * 4 + [TensorProto.FLOAT, TensorProto.INT64] * with_rows
    ranks = (3, 3, 3, 4, 2, 1, 1, 1) + (3, 1) * with_rows
    names = INPUTS + ROW_INPUTS * with_rows
    node = helper.make_node("PagedAttentionPoolRows" if with_rows else "PagedAttentionPool", list(names), ["out"],
                            domain=ort_cpu.DOMAIN, layer=layer, k_column=k_column, v_column=v_column, scale=scale,
                            causal=causal, sliding_window=sliding_window, softcap=softcap)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, [None] * r)
                                            for n, t, r in zip(names, types, ranks)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None] * 3)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                              ir_version=10)
    return proto.SerializeToString()


def session(proto: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])


def case(seed: int, new: list[int], cached: list[int], *, q_heads: int, kv_heads: int, head_dim: int, v_dim: int,
         k_column: int, v_column: int, width: int) -> dict[str, np.ndarray]:
    """A ragged step over a pool whose rows' blocks are shuffled (block 0 left unused)."""
    rng = np.random.default_rng(seed)
    blocks_per_row = [max(1, -(-c // BLOCK)) for c in cached]
    order = rng.permutation(np.arange(1, 1 + sum(blocks_per_row)))
    table = np.zeros((len(new), max(blocks_per_row) + 1), dtype=np.int64)     # a spare column, never read
    start = 0
    for b, n in enumerate(blocks_per_row):
        table[b, :n] = order[start:start + n]
        start += n
    s = sum(new)
    return {
        "q": rng.standard_normal((s, q_heads, head_dim), dtype=np.float32),
        "k": rng.standard_normal((s, kv_heads, head_dim), dtype=np.float32),
        "v": rng.standard_normal((s, kv_heads, v_dim), dtype=np.float32),
        "kv_pool": rng.standard_normal((1 + sum(blocks_per_row), LAYERS, BLOCK, width), dtype=np.float32),
        "block_table": table,
        "row_offsets": np.concatenate([[0], np.cumsum(new)]).astype(np.int64),
        "positions": np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new)]).astype(np.int64),
        "cache_lengths": np.array(cached, dtype=np.int64),
    }


def expected(feeds: dict[str, np.ndarray], *, layer: int, k_column: int, v_column: int, **attrs) -> np.ndarray:
    """The torch reference over each row's past gathered from the pool (with the in-graph rows written over
    their slots, as export/archs/common.scatter_rows does, when the feeds have them)."""
    _, kv_heads, head_dim = feeds["k"].shape
    v_dim = feeds["v"].shape[2]
    past = gather_pool(torch.from_numpy(feeds["kv_pool"]), torch.from_numpy(feeds["block_table"]))  # [L, B, P, W]
    if "rows" in feeds:
        slots = past.shape[2]
        index = torch.from_numpy(feeds["row_index"])
        past = scatter_rows(past, torch.from_numpy(feeds["rows"]).permute(1, 0, 2), index // slots, index % slots)
    past = past[layer]                                                                               # [B, P, W]
    k_cache = past[..., k_column:k_column + kv_heads * head_dim].unflatten(-1, (kv_heads, head_dim))
    v_cache = past[..., v_column:v_column + kv_heads * v_dim].unflatten(-1, (kv_heads, v_dim))
    t = {n: torch.from_numpy(feeds[n]) for n in ("q", "k", "v", "row_offsets", "positions", "cache_lengths")}
    return reference(t["q"], t["k"], t["v"], k_cache, v_cache, t["row_offsets"], t["positions"],
                     t["cache_lengths"], **attrs).numpy()


GEOMETRIES = [   # (new tokens per row, cached per row, q heads, kv heads, head dim, v dim, k column, v column, W)
    ([1], [9], 4, 2, 8, 8, 0, 16, 32),                                  # decode, K then V
    ([3, 1, 4], [4, 0, 6], 6, 2, 5, 7, 15, 1, 31),                      # ragged, V before K, unequal dims
    ([1, 5, 3, 0, 6], [9, 2, 0, 13, 7], 6, 3, 4, 10, 0, 12, 42),       # a row with no new token
    # several key tiles: 8-token verify (32 queries per kv head, register blocks) beside decode (4 per kv
    # head); v dim 105 = register passes of 64, 32 and 8 columns and a tail
    ([8, 1, 3], [45, 37, 16], 8, 2, 64, 105, 0, 128, 340),
]
ATTRIBUTES = [dict(scale=0.3), dict(scale=0.3, causal=0), dict(scale=0.25, sliding_window=3, softcap=5.0)]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("attrs", ATTRIBUTES)
def test_kernel_equals_the_reference_over_the_gathered_past(geometry, attrs) -> None:
    new, cached, q_heads, kv_heads, head_dim, v_dim, k_column, v_column, width = geometry
    feeds = case(len(new) + len(attrs), new, cached, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 v_dim=v_dim, k_column=k_column, v_column=v_column, width=width)
    for layer in range(LAYERS):
        got = session(model(layer=layer, k_column=k_column, v_column=v_column, **attrs)).run(None, feeds)[0]
        reference_attrs = {**attrs, "causal": bool(attrs.get("causal", 1))}
        want = expected(feeds, layer=layer, k_column=k_column, v_column=v_column, **reference_attrs)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attrs", ATTRIBUTES)
def test_in_graph_rows_replace_the_pool_rows_of_their_slots(attrs) -> None:
    """PagedAttentionPoolRows: some slots of the past, cached and beyond, come from rows computed in the graph."""
    new, cached, q_heads, kv_heads, head_dim, v_dim, k_column, v_column, width = GEOMETRIES[3]
    feeds = case(7, new, [c + 4 for c in cached], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 v_dim=v_dim, k_column=k_column, v_column=v_column, width=width)
    slots = feeds["block_table"].shape[1] * BLOCK
    rng = np.random.default_rng(8)
    # rows 0 and 2: a few slots inside their cached past (the last four positions, as a draft step writes them)
    index = np.array([0 * slots + cached[0] + 1, 2 * slots + cached[2], 0 * slots + cached[0] + 3,
                      2 * slots + cached[2] + 2], dtype=np.int64)
    feeds["rows"] = rng.standard_normal((LAYERS, len(index), width), dtype=np.float32)
    feeds["row_index"] = index
    for layer in range(LAYERS):
        got = session(model(layer=layer, k_column=k_column, v_column=v_column, with_rows=True, **attrs)).run(
            None, feeds)[0]
        reference_attrs = {**attrs, "causal": bool(attrs.get("causal", 1))}
        want = expected(feeds, layer=layer, k_column=k_column, v_column=v_column, **reference_attrs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        plain = {name: value for name, value in feeds.items() if name not in ROW_INPUTS}
        assert not np.allclose(got, session(model(layer=layer, k_column=k_column, v_column=v_column, **attrs))
                               .run(None, plain)[0])                                 # the rows were read


def test_rows_of_one_layer_are_that_layers_alone() -> None:
    """Rows [1, N, W]: the past is one layer's slice of the pool with the rows written in (Gemma 4's assistant),
    so whichever layer the node reads, the rows are the ones it sees."""
    new, cached, q_heads, kv_heads, head_dim, v_dim, k_column, v_column, width = GEOMETRIES[3]
    feeds = case(9, new, [c + 4 for c in cached], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 v_dim=v_dim, k_column=k_column, v_column=v_column, width=width)
    slots = feeds["block_table"].shape[1] * BLOCK
    index = np.array([0 * slots + cached[0] + 1, 2 * slots + cached[2], 1 * slots + 3], dtype=np.int64)
    one_layer = np.random.default_rng(9).standard_normal((1, len(index), width), dtype=np.float32)
    for layer in range(LAYERS):
        got = session(model(layer=layer, k_column=k_column, v_column=v_column, scale=0.3, with_rows=True)).run(
            None, {**feeds, "rows": one_layer, "row_index": index})[0]
        every_layer = np.repeat(one_layer, LAYERS, axis=0)                  # the same rows in every layer
        want = expected({**feeds, "rows": every_layer, "row_index": index}, layer=layer, k_column=k_column,
                        v_column=v_column, scale=0.3, causal=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"\[layers or 1, N"):
        session(model(layer=0, k_column=k_column, v_column=v_column, scale=0.3, with_rows=True)).run(
            None, {**feeds, "rows": np.zeros((2, len(index), width), np.float32), "row_index": index})


def test_a_row_index_outside_the_batch_is_an_error() -> None:
    new, cached, q_heads, kv_heads, head_dim, v_dim, k_column, v_column, width = GEOMETRIES[0]
    feeds = case(3, new, cached, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
                 k_column=k_column, v_column=v_column, width=width)
    slots = feeds["block_table"].shape[1] * BLOCK
    feeds["rows"], feeds["row_index"] = np.zeros((LAYERS, 1, width), np.float32), np.array([slots], np.int64)
    with pytest.raises(Exception, match="row index outside"):
        session(model(layer=0, k_column=k_column, v_column=v_column, scale=0.3, with_rows=True)).run(None, feeds)


def test_the_pool_is_only_read() -> None:
    feeds = case(3, [2, 3], [5, 8], q_heads=4, kv_heads=2, head_dim=4, v_dim=4, k_column=0, v_column=8, width=16)
    before = feeds["kv_pool"].copy()
    session(model(layer=1, k_column=0, v_column=8, scale=0.5)).run(None, feeds)
    assert np.array_equal(feeds["kv_pool"], before)


@pytest.mark.parametrize("breaks, message", [
    (lambda f: f["block_table"].__setitem__((0, 0), 99), "block table entry outside the pool"),
    (lambda f: f["cache_lengths"].__setitem__(0, 1000), "cache length exceeds"),
    (lambda f: f["row_offsets"].__setitem__(-1, 1), "row_offsets must start at 0 and end"),
])
def test_bad_feeds_are_errors_not_wild_reads(breaks, message) -> None:
    feeds = case(4, [2, 3], [5, 8], q_heads=4, kv_heads=2, head_dim=4, v_dim=4, k_column=0, v_column=8, width=16)
    breaks(feeds)
    with pytest.raises(Exception, match=message):
        session(model(layer=0, k_column=0, v_column=8, scale=0.5)).run(None, feeds)


def test_columns_outside_the_pool_row_are_an_error() -> None:
    feeds = case(5, [1], [3], q_heads=2, kv_heads=1, head_dim=4, v_dim=4, k_column=0, v_column=8, width=16)
    with pytest.raises(Exception, match="outside the pool row"):
        session(model(layer=0, k_column=0, v_column=13, scale=0.5)).run(None, feeds)


def test_the_library_is_built_once_per_source_and_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path))
    first = ort_cpu.library_path()
    assert first.is_file() and tmp_path in first.parents
    stamp = first.stat().st_mtime_ns
    assert ort_cpu.library_path() == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, ort_cpu.STAMP]   # no temporary left


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ort_cpu, "compiler", lambda: None)
    with pytest.raises(ort_cpu.BuildError, match="need a C\\+\\+ compiler"):
        ort_cpu.library_path()
    assert not any(tmp_path.rglob("*.so"))


def test_onnx_accepts_the_node() -> None:
    onnx.checker.check_model(onnx.load_from_string(model(layer=0, k_column=0, v_column=8, scale=0.5)))
