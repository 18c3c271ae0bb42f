"""unispec.cpu::PagedAttentionRope(Rows): a layer's q/k/v norms, RoPE, KV delta row and paged attention in one
native node. It must equal numpy's per-head RMS norms (q's and k's weighted, any of them absent, v's without a
weight), rotate-half RoPE, then attention over each row's past read from the pool (ragged rows, GQA, causal or
not, a sliding window, in-graph rows over some slots), and report bad feeds as errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from plugins import ort_cpu
from tests.plugins.test_ort_cpu import BLOCK, LAYERS, case, session

POOL_INPUTS = ("kv_pool", "block_table", "row_offsets", "positions", "cache_lengths")
INPUTS = ("q2d", "k2d", "v2d", "cos", "sin", *POOL_INPUTS)


def model(*, q_heads: int, kv_heads: int, head_dim: int, with_rows: bool = False, norms: tuple[str, ...] = (),
          **attrs) -> bytes:
    """The op over graph inputs named as its inputs; `norms`: its optional inputs, "q_norm" and/or "k_norm"
    ("" for an absent one before a present one)."""
    names = INPUTS + ("rows", "row_index") * with_rows
    types = [TensorProto.FLOAT] * 6 + [TensorProto.INT64] * 4 + [TensorProto.FLOAT, TensorProto.INT64] * with_rows
    ranks = (2, 2, 2, 2, 2, 4, 2, 1, 1, 1) + (3, 1) * with_rows
    node = helper.make_node("PagedAttentionRopeRows" if with_rows else "PagedAttentionRope", [*names, *norms],
                            ["out", "delta"], domain=ort_cpu.DOMAIN, q_heads=q_heads, kv_heads=kv_heads,
                            head_dim=head_dim, **{"causal": 1, "sliding_window": 0, "softcap": 0.0, **attrs})
    present = [n for n in norms if n]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, [None] * r)
                                            for n, t, r in zip((*names, *present),
                                                               (*types, *[TensorProto.FLOAT] * len(present)),
                                                               (*ranks, *[1] * len(present)))],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None] * 2),
                               helper.make_tensor_value_info("delta", TensorProto.FLOAT, [None] * 3)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                              ir_version=10)
    return proto.SerializeToString()


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [S, H, D] with half tables [S, D/2] (RotaryEmbedding, interleaved=0)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * c - second * s, second * c + first * s], axis=-1)


def attention(feeds: dict, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, layer: int, k_column: int,
              v_column: int, scale: float, causal: int, sliding_window: int) -> np.ndarray:
    """Each row's new tokens against its past (pool rows by the block table) and its new keys, in float64."""
    pool, table, offsets = feeds["kv_pool"], feeds["block_table"], feeds["row_offsets"]
    q_heads, kv_heads, dim = q.shape[1], k.shape[1], k.shape[2]
    out = np.zeros((q.shape[0], q_heads, v.shape[2]))
    for b, past in enumerate(feeds["cache_lengths"]):
        t0, t1 = offsets[b], offsets[b + 1]
        rows = np.stack([pool[table[b, p // BLOCK], layer, p % BLOCK] for p in range(past)] or
                        [np.zeros(pool.shape[-1], np.float32)])[:past]
        keys = np.concatenate([rows[:, k_column:k_column + kv_heads * dim].reshape(past, kv_heads, dim), k[t0:t1]])
        values = np.concatenate([rows[:, v_column:v_column + kv_heads * v.shape[2]].reshape(past, kv_heads,
                                                                                            v.shape[2]), v[t0:t1]])
        key_at = np.concatenate([np.arange(past), feeds["positions"][t0:t1]])
        cached = np.arange(len(key_at)) < past
        for t in range(t0, t1):
            at = feeds["positions"][t]
            visible = (cached | (not causal) | (key_at <= at)) & ((sliding_window <= 0) | (at - key_at < sliding_window))
            for h in range(q_heads):
                g = h // (q_heads // kv_heads)
                s = np.where(visible, keys[:, g].astype(np.float64) @ q[t, h] * scale, -np.inf)
                w = np.exp(s - s.max())
                out[t, h] = (w / w.sum()) @ values[:, g]
    return out


def rope_case(seed: int, new: list[int], cached: list[int], *, q_heads: int, kv_heads: int, head_dim: int,
              v_dim: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A ragged step (test_ort_cpu.case) as the fused node reads it: 2-D projections and [S, D/2] tables."""
    width = kv_heads * (head_dim + v_dim)
    columns = {"k_column": 0, "v_column": kv_heads * head_dim}
    raw = case(seed, new, cached, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
               width=width, **columns)
    angles = raw["positions"][:, None] * (1.0 / 10000 ** (np.arange(head_dim // 2) / (head_dim // 2)))
    feeds = {"q2d": raw["q"].reshape(len(angles), -1), "k2d": raw["k"].reshape(len(angles), -1),
             "v2d": raw["v"].reshape(len(angles), -1), "cos": np.cos(angles).astype(np.float32),
             "sin": np.sin(angles).astype(np.float32), **{n: raw[n] for n in POOL_INPUTS}}
    return feeds, columns


def rms_norm(x: np.ndarray, weight: np.ndarray | None, epsilon: float) -> np.ndarray:
    """RMSNormalization of x [S, H, D] over D, in float64; no weight: ones."""
    x = x.astype(np.float64)
    normed = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + epsilon)
    return normed if weight is None else normed * weight


def expected(feeds: dict, heads: tuple[int, int, int], *, v_norm: int = 0, norm_epsilon: float = 0.0,
             **attrs) -> tuple[np.ndarray, np.ndarray]:
    """(attention [S, Hq*Dv], delta [S, 1, W]); q (k) normed first when feeds has "q_norm" ("k_norm")."""
    q_heads, kv_heads, dim = heads
    tokens = feeds["q2d"].shape[0]
    q, k = feeds["q2d"].reshape(tokens, q_heads, dim), feeds["k2d"].reshape(tokens, kv_heads, dim)
    v = feeds["v2d"].reshape(tokens, kv_heads, -1)
    if "q_norm" in feeds:
        q = rms_norm(q, feeds["q_norm"], norm_epsilon)
    if "k_norm" in feeds:
        k = rms_norm(k, feeds["k_norm"], norm_epsilon)
    if v_norm:
        v = rms_norm(v, None, norm_epsilon)
    q, k = rope(q, feeds["cos"], feeds["sin"]), rope(k, feeds["cos"], feeds["sin"])
    delta = np.concatenate([k.reshape(tokens, -1), v.reshape(tokens, -1)], axis=-1)[:, None, :]   # [S, 1, W]
    return attention(feeds, q, k, v, **attrs).reshape(tokens, -1), delta


GEOMETRIES = {"gqa": dict(q_heads=4, kv_heads=2, head_dim=8, v_dim=8),          # decode: attend_rows
              "wide-gqa": dict(q_heads=8, kv_heads=1, head_dim=16, v_dim=16),  # 8 queries a kv head: attend_tiled
              "mha-other-v": dict(q_heads=2, kv_heads=2, head_dim=4, v_dim=6)}
ATTRS = {"causal": dict(causal=1, sliding_window=0), "window": dict(causal=1, sliding_window=3),
         "bidirectional": dict(causal=0, sliding_window=0)}


@pytest.mark.parametrize("attrs", ATTRS.values(), ids=ATTRS.keys())
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_kernel_equals_rope_then_attention(geometry, attrs) -> None:
    heads = (geometry["q_heads"], geometry["kv_heads"], geometry["head_dim"])
    for new, cached in (([1, 3, 2], [5, 0, 9]), ([1], [7])):               # a ragged prefill/verify, a decode
        feeds, columns = rope_case(1, new, cached, **geometry)
        out, delta = session(model(q_heads=heads[0], kv_heads=heads[1], head_dim=heads[2], layer=1, scale=0.4,
                                   **columns, **attrs)).run(None, feeds)
        want_out, want_delta = expected(feeds, heads, layer=1, scale=0.4, **columns, **attrs)
        assert out.shape == want_out.shape and delta.shape == want_delta.shape
        np.testing.assert_allclose(delta, want_delta, rtol=0, atol=1e-6)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=2e-5)


NORMS = {"q-k-v": (("q_norm", "k_norm"), 1), "k-only": (("", "k_norm"), 0), "q-only": (("q_norm",), 0),
         "v-only": ((), 1)}


def with_norms(feeds: dict, norms: tuple[str, ...], dim: int) -> dict[str, np.ndarray]:
    """feeds plus a float32 [dim] weight (around 1, never 1) for each named norm."""
    rng = np.random.default_rng(11)
    return {**feeds, **{n: (1.0 + 0.5 * rng.standard_normal(dim)).astype(np.float32) for n in norms if n}}


@pytest.mark.parametrize("norms, v_norm", NORMS.values(), ids=NORMS.keys())
@pytest.mark.parametrize("geometry", [GEOMETRIES["gqa"], GEOMETRIES["mha-other-v"]], ids=["gqa", "mha-other-v"])
def test_norms_come_before_rope(geometry, norms, v_norm) -> None:
    heads = (geometry["q_heads"], geometry["kv_heads"], geometry["head_dim"])
    feeds, columns = rope_case(4, [1, 3, 2], [5, 0, 9], **geometry)
    feeds = with_norms(feeds, norms, heads[2])
    attrs = dict(layer=1, scale=0.4, causal=1, sliding_window=0, v_norm=v_norm, norm_epsilon=0.5)   # epsilon counts
    out, delta = session(model(q_heads=heads[0], kv_heads=heads[1], head_dim=heads[2], norms=norms, **columns,
                               **attrs)).run(None, feeds)
    want_out, want_delta = expected(feeds, heads, **columns, **attrs)
    np.testing.assert_allclose(delta, want_delta, rtol=0, atol=2e-6)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=2e-5)
    unnormed, _ = expected({n: f for n, f in feeds.items() if n not in norms}, heads, **columns,
                           **{**attrs, "v_norm": 0})
    assert np.abs(unnormed - out).max() > 1e-2             # the norms changed the attention


@pytest.mark.parametrize("norms, v_norm", [((), 0), (("q_norm", "k_norm"), 1)], ids=["plain", "normed"])
def test_in_graph_rows_replace_the_pool_rows_of_their_slots(norms, v_norm) -> None:
    geometry = GEOMETRIES["gqa"]
    feeds, columns = rope_case(2, [2, 1], [6, 9], **geometry)
    feeds = with_norms(feeds, norms, geometry["head_dim"])
    slots = feeds["block_table"].shape[1] * BLOCK
    index = np.array([0 * slots + 4, 1 * slots + 0, 1 * slots + 8], dtype=np.int64)      # row b, position p
    rows = np.random.default_rng(5).standard_normal((LAYERS, len(index), feeds["kv_pool"].shape[-1]))
    attrs = dict(layer=2, scale=0.3, v_norm=v_norm, norm_epsilon=1e-6, **columns)
    proto = model(q_heads=4, kv_heads=2, head_dim=8, with_rows=True, norms=norms, **attrs)
    out, _ = session(proto).run(None, {**feeds, "rows": rows.astype(np.float32), "row_index": index})
    written = feeds["kv_pool"].copy()              # the same past, the rows written into the pool itself
    for n, flat in enumerate(index):
        b, p = divmod(int(flat), slots)
        written[feeds["block_table"][b, p // BLOCK], :, p % BLOCK] = rows[:, n]
    want, _ = expected({**feeds, "kv_pool": written}, (4, 2, 8), causal=1, sliding_window=0, **attrs)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    plain, _ = session(model(q_heads=4, kv_heads=2, head_dim=8, norms=norms, **attrs)).run(None, feeds)
    assert np.abs(plain - out).max() > 1e-3       # the rows were read, not the pool's slots


@pytest.mark.parametrize("breaks, message", [
    (lambda f: f.update(cos=f["cos"][:, :2]), "cos and sin"),
    (lambda f: f.update(q2d=f["q2d"][:, :-8]), "q_heads \\* head_dim"),
    (lambda f: f.update(v2d=f["v2d"][:1]), "same S"),
    (lambda f: f.update(row_offsets=f["row_offsets"][:-1]), "row_offsets"),
    (lambda f: f.update(k_norm=f["k_norm"][:-1]), "q_norm and k_norm must be \\[head_dim\\]"),
])
def test_bad_feeds_are_errors_not_wild_reads(breaks, message) -> None:
    feeds, columns = rope_case(3, [2, 1], [4, 5], **GEOMETRIES["gqa"])
    feeds = with_norms(feeds, ("k_norm",), 8)
    breaks(feeds)
    proto = model(q_heads=4, kv_heads=2, head_dim=8, norms=("", "k_norm"), layer=0, scale=1.0, norm_epsilon=1e-6,
                  **columns)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
        session(proto).run(None, feeds)


def test_a_norm_without_its_epsilon_is_an_error() -> None:
    feeds, columns = rope_case(3, [2, 1], [4, 5], **GEOMETRIES["gqa"])
    proto = model(q_heads=4, kv_heads=2, head_dim=8, layer=0, scale=1.0, v_norm=1, **columns)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="norm_epsilon"):
        session(proto).run(None, feeds)
