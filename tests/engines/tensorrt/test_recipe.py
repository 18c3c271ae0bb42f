"""Recipes: the built-in files parse, and every malformed recipe fails with one line naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.tensorrt.recipe import Recipe, builtin_recipes, load_recipe, parse_recipe
from runtime.errors import ConfigError


def test_builtin_recipes_parse_and_default_is_the_default() -> None:
    assert {"default", "decode-heavy", "prefill-heavy"} <= set(builtin_recipes())
    assert load_recipe(None) == load_recipe("default")
    decode = load_recipe("decode-heavy")
    assert decode.name == "decode-heavy" and decode.opt_tokens_per_row == 1
    assert decode.cuda_graph_batches == (1, 2, 4, 8, 16)
    assert load_recipe("prefill-heavy").opt_batch == 1


def test_a_recipe_file_is_read_with_its_stem_as_name(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('description = "x"\nbuilder_optimization_level = 5\nmax_workspace_bytes = 1024\n'
                    'tactic_sources = ["CUBLAS_LT"]\nnum_blocks = 300\nrequire_plugins = true\n')
    recipe = load_recipe(path)
    assert recipe == Recipe(name="mine", description="x", builder_optimization_level=5, max_workspace_bytes=1024,
                            tactic_sources=("CUBLAS_LT",), num_blocks=300, require_plugins=True)
    assert load_recipe(str(path)) == recipe


def test_compute_capabilities_are_normalized_rtx_targets(tmp_path: Path) -> None:
    path = tmp_path / "rtx.toml"
    path.write_text('compute_capabilities = ["8.6", "SM89", "sm_120"]\n')
    assert load_recipe(path).compute_capabilities == ("sm_86", "sm_89", "sm_120")


@pytest.mark.parametrize("text, match", [
    ("opt_bath = 4\n", "unknown key 'opt_bath'"),
    ("fp16 = true\n", "unknown key 'fp16'"),
    ('opt_batch = "eight"\n', "opt_batch must be int"),
    ("opt_batch = true\n", "opt_batch must be int"),
    ("require_plugins = 1\n", "require_plugins must be bool"),
    ("cuda_graph_batches = 4\n", "cuda_graph_batches must be a list of int"),
    ("cuda_graph_batches = [4, 2]\n", "increasing batch sizes"),
    ("builder_optimization_level = 9\n", "must be in 0..5"),
    ("opt_batch = 0\n", "opt_batch must be >= 1"),
    ("opt_tokens = 8\nopt_tokens_per_row = 1\n", "not both"),
    ('tactic_sources = ["CUBLASS"]\n', "unknown tactic_sources"),
    ('compute_capabilities = ["sm_90"]\n', r"must name TensorRT-RTX targets from \['sm_75'"),
    ('compute_capabilities = []\n', "must name TensorRT-RTX targets"),
    ('compute_capabilities = ["turing"]\n', "compute capability 'turing': write it as sm_86"),
    ("[profile]\nopt_batch = 2\n", "unknown key 'profile'"),
    ("opt_batch = \n", "not valid TOML"),
])
def test_bad_recipes_fail_in_one_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_recipe(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_an_unknown_recipe_name_lists_the_builtins() -> None:
    with pytest.raises(ConfigError, match="no such file and no built-in recipe.*decode-heavy"):
        load_recipe("decode-heavvy")


def test_parse_recipe_checks_like_a_file() -> None:
    assert parse_recipe({"opt_batch": 2}, name="inline").opt_batch == 2
    with pytest.raises(ConfigError, match="recipe 'inline': unknown key 'bf16'"):
        parse_recipe({"bf16": True}, name="inline")
