"""plugins/function_cache.py: a reference function is exported once per key and machine, then read back."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from plugins import function_cache


def _function(name: str) -> onnx.FunctionProto:
    node = onnx.helper.make_node("Identity", ["x"], ["y"])
    return onnx.helper.make_function("unispec", name, ["x"], ["y"], [node], [onnx.helper.make_opsetid("", 24)])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path))
    return tmp_path / "functions"


def test_a_stored_function_is_read_back_instead_of_made_again(cache: Path) -> None:
    made = []

    def make() -> onnx.FunctionProto:
        made.append(1)
        return _function("Op")

    first = function_cache.cached("Op-1.pb", make)
    second = function_cache.cached("Op-1.pb", make)
    assert len(made) == 1 and second == first and (cache / "Op-1.pb").is_file()
    assert not list(cache.glob(".*.tmp"))


def test_a_damaged_entry_is_made_again_and_rewritten(cache: Path) -> None:
    cache.mkdir(parents=True)
    (cache / "Op-1.pb").write_bytes(b"\xff\x00 not a protobuf")
    assert function_cache.cached("Op-1.pb", lambda: _function("Op")).name == "Op"
    assert function_cache.cached("Op-1.pb", lambda: pytest.fail("made twice")).name == "Op"


def test_an_unwritable_cache_costs_only_the_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("a file where the cache folder would be")
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path / "file"))
    assert function_cache.cached("Op-1.pb", lambda: _function("Op")).name == "Op"


def test_the_key_changes_with_everything_the_function_depends_on(monkeypatch: pytest.MonkeyPatch) -> None:
    base = function_cache.key("PagedAttention", {"scale": 0.125, "causal": True}, ("FLOAT",), 24)
    assert base == function_cache.key("PagedAttention", {"causal": True, "scale": 0.125}, ("FLOAT",), 24)
    others = {function_cache.key("PagedAttention", {"scale": 0.25, "causal": True}, ("FLOAT",), 24),
              function_cache.key("PagedAttention", {"scale": 0.125, "causal": True}, ("FLOAT16",), 24),
              function_cache.key("PagedAttention", {"scale": 0.125, "causal": True}, ("FLOAT",), 23),
              function_cache.key("PagedMLA", {"scale": 0.125, "causal": True}, ("FLOAT",), 24)}
    monkeypatch.setattr(function_cache, "_fingerprint", lambda: "another plugins/ source")
    others.add(function_cache.key("PagedAttention", {"scale": 0.125, "causal": True}, ("FLOAT",), 24))
    assert base not in others and len(others) == 5


def _doubled_moe(*inputs, **attributes):
    """Another torch reference for the same op: its function computes something else."""
    from plugins.moe.reference import moe

    return moe(*inputs, **attributes) * 2


def test_two_references_of_one_op_never_read_each_others_entry(cache: Path) -> None:
    """SpecAccept has a flat reference (model.onnx, which TensorRT builds) and a lazy one with Ifs (model.ort.onnx):
    keyed by op, attributes and dtypes alone, whichever was exported first was read back for the other."""
    import dataclasses

    import onnx_ir as ir

    from plugins.moe.onnx import SPEC
    from plugins.onnx_common import _reference_function, reference_function

    _reference_function.cache_clear()     # both through the disk cache, whatever this process exported before
    attributes = {"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
                  "routed_scaling_factor": 2.5}
    dtypes = (ir.DataType.FLOAT,) * len(SPEC.inputs)
    plain = reference_function(SPEC, attributes, dtypes)
    doubled = reference_function(dataclasses.replace(SPEC, reference=_doubled_moe), attributes, dtypes)
    assert len(list(cache.iterdir())) == 2
    assert len(doubled.node) > len(plain.node)
    assert function_cache.key("Op", {}, (), 24, "a.flat") != function_cache.key("Op", {}, (), 24, "a.lazy")
