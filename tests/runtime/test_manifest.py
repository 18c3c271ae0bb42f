"""runtime/manifest.py: the artifact's self-description round-trips and refuses damaged content in one line."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from runtime import manifest as io
from runtime.errors import ArtifactError
from runtime.manifest import Manifest, PoolSpec, TensorSpec, TokenizerInfo


def sample() -> Manifest:
    pools = (PoolSpec(name=io.KV_POOL, delta=io.KV_DELTA, num_layers=3, width=64, dtype="bfloat16"),
             PoolSpec(name=io.DRAFT_KV_POOL, delta=io.DRAFT_KV_DELTA, num_layers=1, width=48, dtype="float32"))
    inputs = (TensorSpec(name=io.TOKENS, dtype="int64", shape=("num_tokens",)),
              TensorSpec(name=io.KV_POOL, dtype="bfloat16", shape=("num_blocks", 3, 16, 64)),
              TensorSpec(name=io.DRAFT_KV_POOL, dtype="float32", shape=("num_blocks", 1, 16, 48)),
              TensorSpec(name=io.IN_THINKING_PHASE, dtype="bool", shape=("batch",)))
    outputs = (TensorSpec(name=io.NEXT_DRAFT_TOKENS, dtype="int64", shape=("batch", 2)),)
    return Manifest(method="eagle3", num_speculative_tokens=2, target_arch="llama3", draft_arch="eagle3",
                    vocab_size=320, dtype="bfloat16", block_size=16, max_model_len=100, max_batch_size=4,
                    max_tokens_per_step=64, noise_channels=3, structured_output=True, pools=pools, inputs=inputs,
                    outputs=outputs, ops=("PagedAttention",),
                    tokenizer=TokenizerInfo(files=("tokenizer.json",), bos_token_id=1, eos_token_ids=(2, 7),
                                            think_start_id=300, think_end_id=301),
                    exporter={"torch": "2.13.0"})


def test_write_load_round_trip(tmp_path: Path) -> None:
    manifest = sample()
    path = manifest.write(tmp_path)
    assert path == tmp_path / io.MANIFEST_NAME
    loaded = Manifest.load(tmp_path)
    assert loaded == manifest
    assert isinstance(loaded.inputs[1].shape, tuple) and loaded.inputs[1].shape == ("num_blocks", 3, 16, 64)
    assert loaded.tokenizer.eos_token_ids == (2, 7) and loaded.ops == ("PagedAttention",)
    assert json.loads(path.read_text())["format_version"] == io.FORMAT_VERSION


def test_manifests_without_checkpoint_provenance_still_load() -> None:
    """target_checkpoint / draft_checkpoint came later: older manifests read as None."""
    d = json.loads(replace(sample(), target_checkpoint="/ckpt/target", draft_checkpoint="/ckpt/draft").to_json())
    assert Manifest.from_dict(d).target_checkpoint == "/ckpt/target"
    del d["target_checkpoint"], d["draft_checkpoint"]
    old = Manifest.from_dict(d)
    assert (old.target_checkpoint, old.draft_checkpoint) == (None, None) and old == sample()


def test_geometry_helpers() -> None:
    manifest = sample()
    assert manifest.blocks_per_row() == 7                             # ceil((100 + 2 * 2 + 1) / 16)
    assert manifest.pools[0].bytes_per_token() == 3 * 64 * 2
    assert manifest.kv_bytes_per_token() == 3 * 64 * 2 + 1 * 48 * 4


def edited(change: dict[str, Any]) -> dict[str, Any]:
    d = json.loads(sample().to_json())
    d.update(change)
    return d


@pytest.mark.parametrize(("d", "message"), [
    (edited({"format_version": 99}), "format_version 99"),
    (edited({"colour": "blue"}), "unknown fields \\['colour'\\]"),
    ({k: v for k, v in edited({}).items() if k != "pools"}, "missing or malformed field"),
    (edited({"pools": [{"name": "kv_pool"}]}), "missing or malformed field"),
    (edited({"inputs": [{"name": "tokens", "dtype": "int8", "shape": ["num_tokens"]}]}), "dtype 'int8'"),
    (edited({"inputs": [{"name": "tokens", "dtype": "int64", "shape": ["num_tokens"]}]}),
     "pools \\['kv_pool', 'draft_kv_pool'\\] are not graph inputs"),
])
def test_damaged_manifests_fail_in_one_line(d: dict[str, Any], message: str) -> None:
    with pytest.raises(ArtifactError, match=message) as caught:
        Manifest.from_dict(d)
    assert "\n" not in str(caught.value)


def test_load_refuses_what_is_not_a_manifest(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no manifest.json; not a unispec artifact"):
        Manifest.load(tmp_path)
    (tmp_path / io.MANIFEST_NAME).write_text("{broken")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Manifest.load(tmp_path)
    (tmp_path / io.MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="must hold a JSON object"):
        Manifest.load(tmp_path)


def test_every_file_field_is_a_plain_name_the_target_only_graphs_included() -> None:
    """Issue 39 item 3: target_only's files were the one file fields left unchecked ("../outside/x.onnx" ran)."""
    only = io.TargetOnlyGraph(inputs=sample().inputs, outputs=sample().outputs)
    graphs = {io.STEP: {io.PORTABLE: io.MODEL_NAME, "ort": io.ORT_MODEL_NAME},
              io.TARGET_ONLY: {io.PORTABLE: "target_only.onnx", "ort": "target_only.ort.onnx"}}
    manifest = replace(sample(), target_only=only, graphs=graphs, engine={"plan": "engine.plan"})
    for key, value in (("ort", "../outside/model.ort.onnx"), ("ort", "/abs/x.onnx"),
                       ("portable", "sub/target_only.onnx"), ("portable", None)):
        d = json.loads(manifest.to_json())
        d["graphs"][io.TARGET_ONLY][key] = value
        with pytest.raises(ArtifactError, match=rf"^manifest: graphs\.target_only\.{key} is {re.escape(repr(value))}; "
                                                "expected a plain file name inside the artifact directory"):
            Manifest.from_dict(d)
    assert [f for f, _ in io.named_files(manifest)] == [
        "graphs.step.portable", "graphs.step.ort", "graphs.target_only.portable", "graphs.target_only.ort",
        "weights_file", "tokenizer.files[0]", "engine.plan", "engine.settings"]
    assert {"target_only.onnx", "target_only.ort.onnx"} <= set(io.artifact_files(manifest))   # replaced with it


def test_manifests_naming_their_graphs_in_the_old_fields_still_load() -> None:
    """Issue 38: the backend-named model_file / ort_model_file (top level and target_only) became the graph
    map; artifacts already on disk read into it, and every backend finds its file there."""
    only = io.TargetOnlyGraph(inputs=sample().inputs, outputs=sample().outputs)
    graphs = {**sample().graphs, io.TARGET_ONLY: {io.PORTABLE: "target_only.onnx"}}
    d = json.loads(replace(sample(), target_only=only, graphs=graphs).to_json())
    del d["graphs"]
    d.update(model_file="model.onnx", ort_model_file="model.ort.onnx")
    d["target_only"].update(model_file="target_only.onnx", ort_model_file=None)
    manifest = Manifest.from_dict(d)
    assert manifest.graphs == {io.STEP: {io.PORTABLE: "model.onnx", "ort": "model.ort.onnx"},
                               io.TARGET_ONLY: {io.PORTABLE: "target_only.onnx"}}
    assert (manifest.model_file, manifest.graph_file(io.STEP, "ort")) == ("model.onnx", "model.ort.onnx")
    assert manifest.graph_file(io.TARGET_ONLY, "ort") is None
    del d["target_only"], d["model_file"], d["ort_model_file"]          # older still: model.onnx by default
    assert Manifest.from_dict(d).graphs == {io.STEP: {io.PORTABLE: io.MODEL_NAME}}
    assert "ort_model_file" not in json.loads(manifest.to_json())       # written back in the new form


def test_the_graph_map_names_exactly_the_graphs_the_manifest_has() -> None:
    only = io.TargetOnlyGraph(inputs=sample().inputs, outputs=sample().outputs)
    with pytest.raises(ArtifactError, match=r"^manifest: graphs is .*; expected an object mapping step and target_only"):
        replace(sample(), target_only=only)                    # its graph has no files
    with pytest.raises(ArtifactError, match=r"^manifest: graphs is .*; expected an object mapping step to"):
        replace(sample(), graphs={io.STEP: {"ort": io.ORT_MODEL_NAME}})      # no portable graph


def test_specs_validate_dtypes_and_manifests_are_frozen() -> None:
    with pytest.raises(ArtifactError, match="tensor 'x' has dtype 'float64'"):
        TensorSpec(name="x", dtype="float64", shape=(1,))
    manifest = sample()
    with pytest.raises(AttributeError):
        manifest.method = "none"  # type: ignore[misc]
    assert replace(manifest, engine={"plan": "engine.plan"}).engine == {"plan": "engine.plan"}


def test_blocks_per_row_cover_the_steps_reach() -> None:
    assert io.blocks_per_row(13, num_speculative_tokens=2, block_size=4) == -(-(13 + io.step_reach(2)) // 4) == 5


def test_the_k_bound_is_the_recorded_drafters_not_the_method_names() -> None:
    """A block drafter may have K = 31, any other 16; the method's name is never read for it, and a manifest
    written before the drafter field (None) gets the larger bound."""
    block = replace(sample(), method="eagle3", drafter="block", num_speculative_tokens=io.MAX_BLOCK_DRAFT_TOKENS)
    assert Manifest.from_dict(json.loads(block.to_json())) == block
    with pytest.raises(ArtifactError, match="num_speculative_tokens is 17; expected an int in \\[0, 16\\]"):
        replace(sample(), method="dflash", drafter="sequential", num_speculative_tokens=17)
    d = json.loads(replace(sample(), num_speculative_tokens=20).to_json())
    del d["drafter"]
    assert Manifest.from_dict(d).drafter is None and Manifest.from_dict(d).num_speculative_tokens == 20
    with pytest.raises(ArtifactError, match="drafter is 'tree'; expected one of none, sequential, block, assistant"):
        replace(sample(), drafter="tree")
