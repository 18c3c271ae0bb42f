"""runtime/artifact_check.py and the manifest's bounds, as a crafted or edited artifact meets them: every
edit of K, block_size, a pool's width or dtype, vocab_size fails at load in one line naming the field
(`LLM` and `unispec inspect`), files the manifest names must lie inside the artifact, sizes that would
allocate gigabytes are refused before anything is allocated, and a fuzz over every manifest field (types,
zero, negative, huge, paths) gives one line or the reference output, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from runtime import manifest as io
from runtime.artifact_check import check_artifact, read_graph, step_buffer_bytes
from runtime.errors import ArtifactError, UnispecError
from runtime.llm import LLM
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX
from unispec.cli import main

CASE = "llama3-eagle3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 6, 7]
SMALL_BUDGET = 64 * 2**20           # step buffers: what a tiny artifact needs many times over


@pytest.fixture(scope="module")
def source(tiny_artifact) -> Path:
    return tiny_artifact(CASE).path


@pytest.fixture(scope="module")
def reference(source) -> list[int]:
    return LLM(source, num_blocks=32).generate([PROMPT], GREEDY)[0].token_ids


@pytest.fixture
def edited(source, tmp_path):
    """A copy of the artifact whose manifest.json is `change(dict)`; returns its directory."""
    directory = shutil.copytree(source, tmp_path / "artifact")

    def edit(change) -> Path:
        d = json.loads((source / io.MANIFEST_NAME).read_text())
        change(d)
        (directory / io.MANIFEST_NAME).write_text(json.dumps(d))
        return directory

    return edit


def one_line(error: BaseException) -> str:
    assert isinstance(error, UnispecError), f"{type(error).__name__}: {error}"
    assert "\n" not in str(error) and str(error)
    return str(error)


def refused(directory: Path, **options: Any) -> str:
    with pytest.raises(UnispecError) as info:
        LLM(directory, num_blocks=32, **options)
    return one_line(info.value)


# --- item 4: the manifest against the graph --------------------------------------------------------------------

@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.update(num_speculative_tokens=2), "num_speculative_tokens is 2"),
    (lambda d: d.update(block_size=8), "block_size is 8"),
    (lambda d: d.update(block_size="sixteen"), "block_size is 'sixteen'"),
    (lambda d: d.update(block_size=0), "block_size is 0"),
    (lambda d: d["pools"][0].update(width=32), "pools[0].width is 32"),
    (lambda d: d["pools"][1].update(num_layers=2), "pools[1].num_layers is 2"),
    (lambda d: d["pools"][0].update(dtype="float16"), "pools[0].dtype is 'float16'"),
    (lambda d: d.update(noise_channels=4), "noise_channels is 4"),
    (lambda d: d.update(vocab_size=1000), "vocab_size is 1000"),
    (lambda d: d.update(structured_output=True), "structured_output is True"),
    (lambda d: d["inputs"][0].update(dtype="int32"), "inputs['tokens'] is int32"),
    (lambda d: d.update(outputs=[o for o in d["outputs"] if o["name"] != "draft_kv_delta"]),
     "outputs do not list the graph's ['draft_kv_delta']"),
])
def test_an_edited_field_is_named_at_load_and_by_inspect(edited, change, field: str) -> None:
    directory = edited(change)
    assert field in refused(directory)
    result = CliRunner().invoke(main, ["inspect", str(directory)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert field in result.output and result.output.strip().count("\n") == 0


def test_a_vocab_larger_than_the_graph_is_refused_for_structured_artifacts_too(tiny_artifact, tmp_path) -> None:
    directory = shutil.copytree(tiny_artifact(CASE + JSON_SUFFIX).path, tmp_path / "json")
    d = json.loads((directory / io.MANIFEST_NAME).read_text())
    d["vocab_size"] = 1000
    (directory / io.MANIFEST_NAME).write_text(json.dumps(d))
    assert "vocab_size is 1000" in refused(directory)         # it blamed the scheduler's buffer bounds


def test_the_graph_reader_finds_the_token_embedding(source, tiny_artifact) -> None:
    for directory in (source, tiny_artifact(CASE + JSON_SUFFIX).path):
        manifest = Manifest.load(directory)
        graph = check_artifact(directory, manifest)
        assert graph.embedding_rows == manifest.vocab_size
        assert set(graph.inputs) == {t.name for t in manifest.inputs}


# --- item 7: paths ------------------------------------------------------------------------------------------------

def test_every_named_file_lies_inside_the_artifact(edited, tiny_artifact, tmp_path) -> None:
    elsewhere = tiny_artifact(CASE + JSON_SUFFIX).path / io.ORT_MODEL_NAME      # a real graph, outside
    step = ("graphs", io.STEP)
    for path, value in (((*step, "ort"), str(elsewhere)), ((*step, "ort"), "../json/model.ort.onnx"),
                        (("weights_file",), "/etc/passwd"), ((*step, io.PORTABLE), "sub/model.onnx")):
        message = refused(edited(lambda d, p=path, v=value: _put(d, p, v)))
        assert f"manifest: {'.'.join(path)} is " in message and "a plain file name inside the artifact" in message
    assert "tokenizer.files[0]" in refused(edited(lambda d: d["tokenizer"].update(files=["../../x"])))
    assert "engine.plan" in refused(edited(lambda d: d.update(engine={"plan": "/etc/passwd"})))
    directory = edited(lambda d: d.update(weights_file="weights.bin"))
    os.symlink(elsewhere.parent / io.WEIGHTS_NAME, directory / "weights.bin")      # a link out of it
    assert "outside the artifact directory" in refused(directory)


def test_the_target_only_graphs_lie_inside_the_artifact_too(edited, source, tmp_path) -> None:
    """Issue 39 item 3: a target_only path leading out of the artifact was loaded and run."""
    os.symlink(source, tmp_path / "outside")          # so "../outside/..." names a real, loadable graph
    for key, value in (("ort", "../outside/target_only.ort.onnx"),
                       (io.PORTABLE, str(source / "target_only.onnx")), (io.PORTABLE, None)):
        message = refused(edited(lambda d, k=key, v=value: d["graphs"][io.TARGET_ONLY].update({k: v})))
        assert message.startswith(f"manifest: graphs.target_only.{key} is ") and "expected a plain file name" in message
    directory = edited(lambda d: d["graphs"][io.TARGET_ONLY].update(ort="linked.onnx"))
    os.symlink(source / "target_only.ort.onnx", directory / "linked.onnx")      # a plain name, linked out
    message = refused(directory)
    assert message.startswith("manifest: graphs.target_only.ort names linked.onnx, which resolves to ")
    assert "outside the artifact directory" in message
    os.symlink("loop.onnx", directory / "loop.onnx")
    message = refused(edited(lambda d: d["graphs"][io.TARGET_ONLY].update(portable="loop.onnx")))
    assert "graphs.target_only.portable names loop.onnx, a symbolic link that loops back on itself" in message


# --- issue 39 item 9c: an onnxruntime too old is not a damaged artifact ------------------------------------------

def test_an_onnxruntime_too_old_for_the_artifact_is_named_with_the_upgrade(edited, source, monkeypatch) -> None:
    import onnx
    import onnxruntime

    from runtime.backends import ort

    newer = edited(lambda d: None)                   # a graph stamped with an IR version no onnxruntime knows
    model = onnx.load(str(newer / io.ORT_MODEL_NAME), load_external_data=False)
    model.ir_version = 99
    onnx.save(model, str(newer / io.ORT_MODEL_NAME))
    message = refused(newer)
    assert "Unsupported model IR version: 99, max supported IR version: " in message and "damaged" not in message
    assert f"onnxruntime {onnxruntime.__version__} cannot load it" in message
    assert "pip install -U onnxruntime" in message

    def refuse_ir_10(*args: object, **kwargs: object) -> None:    # what an onnxruntime before IR 10 raises
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model from model.ort.onnx failed:/onnxruntime_src/"
                           "model.cc:125 Unsupported model IR version: 10, max supported IR version: 9\n")

    monkeypatch.setattr(onnxruntime, "__version__", "1.16.3")
    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse_ir_10)
    message = refused(source)
    assert "onnxruntime 1.16.3 cannot load it (Unsupported model IR version: 10, max supported IR version: 9): " \
           "unispec needs onnxruntime >= 1.31 (ONNX IR 10, opset 24); pip install -U onnxruntime" in message
    assert "damaged" not in message
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f"onnxruntime>={'.'.join(map(str, ort.MIN_ORT_VERSION))}" in pyproject      # one floor, said twice


# --- item 2: memory -----------------------------------------------------------------------------------------------

def test_sizes_from_a_crafted_manifest_are_refused_before_anything_is_allocated(edited) -> None:
    huge = edited(lambda d: d.update(max_batch_size=10**9, max_tokens_per_step=10**9))
    assert "max_batch_size is 1000000000; expected an int in [1, 4096]" in refused(huge)
    result = CliRunner().invoke(main, ["run", str(huge), "--prompt-ids", "5,6"])     # it allocated ~24 GB
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "max_batch_size is 1000000000" in result.output
    within_bounds = edited(lambda d: d.update(max_batch_size=4096, max_tokens_per_step=131072))
    need = step_buffer_bytes(Manifest.load(within_bounds))
    assert need > SMALL_BUDGET
    tracemalloc.start()
    try:
        message = refused(within_bounds, step_memory_bytes=SMALL_BUDGET)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "persistent host buffers, above the 0.0625 GiB budget" in message
    assert peak < SMALL_BUDGET // 4                         # nothing was sized from the manifest


def test_pools_beyond_the_machine_are_refused_in_one_line(source) -> None:
    with pytest.raises(UnispecError) as info:
        LLM(source, num_blocks=10**12)
    assert "num_blocks=1000000000000 is invalid" in one_line(info.value)
    with pytest.raises(UnispecError) as info:
        LLM(source, num_blocks=2**30)                       # in range, but terabytes of pools
    assert "more than this machine's" in one_line(info.value)


def _put(d: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    for key in path[:-1]:
        d = d[key]
    d[path[-1]] = value


# --- the fuzz: every manifest field -----------------------------------------------------------------------------

VALUES = ("x", None, True, 0, -1, 10**30, [1], {"a": 1})
PATHS = ("/etc/passwd", "../artifact/model.onnx", "sub/model.onnx", "", ".", "..", "model.onnx\0")


def mutations(d: dict[str, Any]) -> list[tuple[str, Any]]:
    """(where, change) for every field, nested ones included: wrong types, zero, negative, huge, paths."""
    found: list[tuple[str, Any]] = []

    def put(path: tuple, value: Any) -> None:
        def change(m: dict[str, Any], path=path, value=value) -> None:
            target = m
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
        found.append((f"{'.'.join(map(str, path))}={value!r}", change))

    for key in d:
        for value in VALUES:
            put((key,), value)
    for path in (("weights_file",), ("graphs", io.STEP, io.PORTABLE), ("graphs", io.STEP, "ort")):
        for value in (*PATHS, *VALUES):
            put(path, value)
    for key in ("num_speculative_tokens", "block_size", "max_model_len", "max_batch_size",
                "max_tokens_per_step", "vocab_size", "noise_channels"):
        put((key,), 2**24)                                  # in range for some, every one a large allocation
    for index in (0, 1):
        for key in ("name", "delta", "num_layers", "width", "dtype"):
            for value in (*VALUES[:6], 10**6):
                put(("pools", index, key), value)
    for kind, index in (("inputs", 0), ("inputs", 6), ("outputs", 3)):
        for value in ("x", ["x"], [5], [], [-1], ["num_tokens", "num_tokens"], [10**12, 3, 4, 64]):
            put((kind, index, "shape"), value)
        put((kind, index, "dtype"), "float64")
    for key, values in (("files", (["../x"], ["/etc/passwd"], "x", [1])), ("eos_token_ids", ([10**9], [-1], "x")),
                        ("bos_token_id", (-1, 10**9, "x")), ("think_start_id", (10**30,))):
        for value in values:
            put(("tokenizer", key), value)
    return found


def test_every_manifest_field_mutated_fails_in_one_line_or_still_serves(source, reference, edited) -> None:
    base = json.loads((source / io.MANIFEST_NAME).read_text())
    cases = mutations(base)
    assert len(cases) > 200
    loaded = 0
    for where, change in cases:
        directory = edited(change)
        try:
            llm = LLM(directory, num_blocks=32, step_memory_bytes=SMALL_BUDGET)
        except Exception as exc:                             # noqa: BLE001 - the assertion names it
            assert isinstance(exc, UnispecError) and "\n" not in str(exc), f"{where}: {type(exc).__name__}: {exc}"
            continue
        loaded += 1
        try:
            out = llm.generate([PROMPT], GREEDY)[0].token_ids
        except Exception as exc:                             # noqa: BLE001
            assert isinstance(exc, UnispecError) and "\n" not in str(exc), f"{where}: {type(exc).__name__}: {exc}"
        else:
            assert out == reference, where
        assert llm.engine.blocks.num_free == llm.num_blocks and not llm.engine.has_unfinished(), where
    assert 0 < loaded < len(cases) // 2                      # harmless edits (provenance, ops, ...) still load


def test_the_graph_is_read_without_its_weights(source, tmp_path) -> None:
    graph = read_graph(source / io.MODEL_NAME)
    assert io.KV_POOL in graph.inputs and io.KV_DELTA in graph.outputs
    bad = tmp_path / "not-onnx.onnx"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(ArtifactError, match="not a readable ONNX model"):
        read_graph(bad)
