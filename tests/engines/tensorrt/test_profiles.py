"""Optimization profiles from manifests: ranges per dim, shapes per input, opt from recipes, pool sizing."""

from __future__ import annotations

import dataclasses

import pytest

from engines.tensorrt.profiles import DimRange, dim_ranges, input_shapes, pool_blocks
from engines.tensorrt.recipe import Recipe, load_recipe
from runtime import manifest as io
from runtime.errors import ArtifactError, ConfigError
from runtime.manifest import TensorSpec, dim_value
from tests.engines.manifests import make_manifest

M = make_manifest()        # K=3, block 4, max_model_len 128, batch 8, 64 tokens per step, pools (3, 64), (1, 64)


def test_default_ranges_span_the_manifest_bounds() -> None:
    dims = dim_ranges(M, Recipe())
    # a row reserves ceil((128 + 2*3 + 1) / 4) = 34 blocks, as the runtime's scheduler does
    assert dims == {"batch": DimRange(1, 8, 8), "num_tokens": DimRange(1, 64, 64),
                    "max_blocks": DimRange(1, 34, 34), "num_blocks": DimRange(1, 8 * 34, 8 * 34)}


def test_input_shapes_evaluate_dim_expressions_at_min_opt_max() -> None:
    shapes = input_shapes(M, dim_ranges(M, load_recipe("decode-heavy")))
    assert list(shapes) == [t.name for t in M.inputs]      # every input has a dynamic dim, graph order kept
    assert (shapes[io.TOKENS].min, shapes[io.TOKENS].opt, shapes[io.TOKENS].max) == ((1,), (8,), (64,))
    assert (shapes[io.ROW_OFFSETS].min, shapes[io.ROW_OFFSETS].max) == ((2,), (9,))
    assert shapes[io.BLOCK_TABLE].max == (8, 34) and shapes[io.BLOCK_TABLE].min == (1, 1)
    assert shapes[io.DRAFT_TOKENS].min == (1, 3)
    assert shapes[io.KV_POOL].max == (272, 3, 4, 64) and shapes[io.DRAFT_KV_POOL].min == (1, 1, 4, 64)
    assert shapes[io.NOISE].opt == (8, 4, 3)


def test_static_inputs_get_no_profile_entry() -> None:
    m = make_manifest(bitmask=True)
    static = TensorSpec(name="static_thing", dtype="int64", shape=(4, 2))
    m = dataclasses.replace(m, inputs=(*m.inputs, static))
    shapes = input_shapes(m, dim_ranges(m, Recipe()))
    assert "static_thing" not in shapes
    assert shapes[io.TOKEN_BITMASK].max == (8, 4, 10)


@pytest.mark.parametrize("recipe, batch, tokens, blocks", [
    (Recipe(opt_batch=4), 4, 64, 34),
    (Recipe(opt_batch=4, opt_tokens_per_row=1), 4, 4, 34),
    (Recipe(opt_tokens_per_row=1), 8, 8, 34),
    (Recipe(opt_batch=100, opt_tokens=1000), 8, 64, 34),         # clamped into the artifact's ranges
    (Recipe(opt_batch=6, opt_tokens=2), 6, 6, 34),               # S >= B: each row brings a token
    (Recipe(opt_context_len=9), 8, 64, 4),                        # ceil((9 + 7) / 4)
    (Recipe(opt_context_len=10_000), 8, 64, 34),
])
def test_opt_comes_from_the_recipe_clamped(recipe: Recipe, batch: int, tokens: int, blocks: int) -> None:
    dims = dim_ranges(M, recipe)
    assert (dims["batch"].opt, dims["num_tokens"].opt, dims["max_blocks"].opt) == (batch, tokens, blocks)


def test_pool_size_from_recipe_or_budget() -> None:
    assert pool_blocks(M, Recipe(num_blocks=50)) == 50
    block_bytes = M.kv_bytes_per_token() * M.block_size               # (3*64 + 64) * 4 bytes * 4 tokens
    assert block_bytes == 4096
    assert pool_blocks(M, Recipe(kv_memory_bytes=100 * block_bytes + 5)) == 100
    assert pool_blocks(M, Recipe(kv_memory_bytes=10**12)) == 8 * 34  # a larger budget buys nothing more
    with pytest.raises(ConfigError, match="fewer than one max_model_len row needs \\(34\\)"):
        pool_blocks(M, Recipe(kv_memory_bytes=10 * block_bytes))
    assert dim_ranges(M, Recipe(num_blocks=50))["num_blocks"] == DimRange(1, 50, 50)


def test_k_zero_and_row_blocks() -> None:
    m = make_manifest(k=0, max_model_len=100, block_size=16)
    assert m.blocks_per_row() == 7                                         # ceil(101 / 16)
    shapes = input_shapes(m, dim_ranges(m, Recipe()))
    assert shapes[io.DRAFT_TOKENS].max == (8, 0)


def test_eval_dim_and_unknown_names() -> None:
    env = {"batch": 3, "num_tokens": 10}
    assert dim_value(7, env) == 7 and dim_value("batch + 1", env) == 4 and dim_value("3*batch + num_tokens", env) == 19
    assert dim_value("2 * batch * 2", env) == 12
    with pytest.raises(ArtifactError, match="'kv_delta' has dimension 'seq_len' naming 'seq_len'"):
        dim_value("seq_len", env, tensor="kv_delta")
    bad = TensorSpec(name="mystery", dtype="int64", shape=("sequence",))
    m = dataclasses.replace(M, inputs=(*M.inputs, bad))
    with pytest.raises(ArtifactError, match="mystery"):
        input_shapes(m, dim_ranges(m, Recipe()))
