"""export/artifact.py: the artifact directory of DESIGN.md §6 written by `export_model`.

Two real exports (module-scoped): the tiny Llama 3 target alone (`none`) and with its Eagle3 head
(which uses the target's embedding, so the shared-tensor rule is exercised). The failure and replace
cases reuse them and patch the stages around the trace, so they cost no extra trace.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from engines.ort.build import build as ort_build
from engines.ort.build import lowered_name
from export import artifact
from export import target_only as target_only_files
from export.artifact import read_artifact
from export.methods import build_step
from export.onnx_files import EXTERNAL_MIN_BYTES
from export.tiny import write_tiny
from plugins import ort_cpu
from plugins.spec_accept.acceptance import NOISE_CHANNELS
from runtime import manifest as io
from runtime.errors import ArtifactError, ExportError
from runtime.manifest import Manifest
from tests.export.artifact_files import THINK_END, THINK_START, add_tokenizer_files, largest_inline_tensor
from unispec.exporting import export_model

K = 2
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    written = write_tiny(family="llama3", method="eagle3", out_dir=tmp_path_factory.mktemp("tiny"), seed=0)
    add_tokenizer_files(written["target"])
    return written


@pytest.fixture(scope="module")
def artifacts(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    return {
        "none": export_model(checkpoints["target"], method="none", num_speculative_tokens=3,
                             out_dir=root / "none", progress=False),
        "eagle3": export_model(checkpoints["target"], checkpoints["draft"], method="eagle3",
                               num_speculative_tokens=K, out_dir=root / "nested" / "eagle3", progress=False),
    }


def step_of(method: str, checkpoints: dict[str, Path]) -> torch.nn.Module:
    draft = checkpoints["draft"] if method == "eagle3" else None
    return build_step(method, checkpoints["target"], draft, k=K)


def tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# --- files, checker, weights ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_files_pass_the_checker_with_external_weights(artifacts: dict[str, Path], method: str) -> None:
    path = artifacts[method]
    only = target_only_files.MODEL_NAME
    target_only = [only, lowered_name(only)] if method != "none" else []
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [io.MODEL_NAME, io.ORT_MODEL_NAME, io.WEIGHTS_NAME, io.MANIFEST_NAME, "tokenizer.json",
         "tokenizer_config.json", "generation_config.json", *target_only])
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]     # no temp or old dirs left
    onnx.checker.check_model(str(path / io.MODEL_NAME), full_check=True)
    model = onnx.load(str(path / io.MODEL_NAME), load_external_data=False)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")] == [("", 24)]
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    weights = [t for t in model.graph.initializer if t.data_type in (1, 10, 16) and np.prod(t.dims) > 1]
    assert {t.name for t in weights} <= {t.name for t in external}
    assert all(dict((e.key, e.value) for e in t.external_data)["location"] == io.WEIGHTS_NAME for t in external)
    lengths = sum(int(dict((e.key, e.value) for e in t.external_data)["length"]) for t in external)
    assert lengths == (path / io.WEIGHTS_NAME).stat().st_size
    assert sum(len(t.raw_data) for t in model.graph.initializer) < 4096        # inline: a few scalars and axes


def test_shared_target_draft_tensors_are_stored_once(artifacts: dict[str, Path],
                                                     checkpoints: dict[str, Path]) -> None:
    step = step_of("eagle3", checkpoints)
    by_storage = {p.data_ptr(): p for p in step.parameters()}
    names = [n for n, _ in step.named_parameters(remove_duplicate=False)]
    assert {"target.embed_tokens.weight", "drafter.embed_tokens.weight"} <= set(names)  # the shared Parameter
    unique_bytes = sum(p.numel() * p.element_size() for p in by_storage.values())
    counted_twice = sum(p.numel() * p.element_size() for _, p in step.named_parameters(remove_duplicate=False))
    buffers = sum(b.numel() * b.element_size() for b in step.buffers())
    size = (artifacts["eagle3"] / io.WEIGHTS_NAME).stat().st_size
    assert unique_bytes <= size <= unique_bytes + buffers + 16_384               # folded rope tables etc.
    assert size < counted_twice - 40_000                                         # the embedding is not doubled

    model = onnx.load(str(artifacts["eagle3"] / io.MODEL_NAME))
    contents = [(t.data_type, tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes())
                for t in model.graph.initializer if len(t.raw_data) >= 1024]
    assert len(contents) == len(set(contents))
    embedding = step.target.embed_tokens.weight.detach().numpy().tobytes()
    assert sum(c[2] == embedding for c in contents) == 1


def test_eagle3_artifact_runs_in_onnxruntime_like_torch(artifacts: dict[str, Path],
                                                        checkpoints: dict[str, Path]) -> None:
    import onnxruntime as ort

    from export.onnx_export import example_feeds

    step = step_of("eagle3", checkpoints)
    feeds = example_feeds(step, lengths=(1, 5, 2, 3), cache_lengths=(7, 2, 0, 12), block_size=16, vocab=320, seed=1)
    want = step.run(feeds)
    session = ort.InferenceSession(str(artifacts["eagle3"] / io.MODEL_NAME), providers=["CPUExecutionProvider"])
    got = session.run(list(step.output_names), {n: feeds[n].numpy() for n in step.input_names})
    for name, value in zip(step.output_names, got):
        assert value.shape == tuple(want[name].shape), name
        assert np.allclose(value, want[name].numpy(), atol=1e-4), name


def test_the_ort_graph_reads_the_pools_in_place_and_computes_the_same(artifacts: dict[str, Path],
                                                                       checkpoints: dict[str, Path]) -> None:
    """model.ort.onnx: every target layer's attention and the draft's first step read their pool through the
    native kernel (no Gather of the pool left), later draft steps (which also read this step's rows) keep
    the exported attention; outputs equal torch's."""
    import onnxruntime as ort

    from engines.ort.attention_fusion import FUSED_OP
    from engines.ort.lowering import NATIVE_DOMAIN, NATIVE_OP
    from export.onnx_export import example_feeds
    from plugins import ort_cpu

    step = step_of("eagle3", checkpoints)
    graph = onnx.load(str(artifacts["eagle3"] / io.ORT_MODEL_NAME), load_external_data=False).graph
    native = [n for n in graph.node if n.domain == NATIVE_DOMAIN and n.op_type in (NATIVE_OP, FUSED_OP)]
    assert len(native) == step.target.config.num_hidden_layers + 1
    pools = sorted(n.input[3 if n.op_type == NATIVE_OP else 5] for n in native)   # the fused op reads cos, sin first
    assert pools == [io.DRAFT_KV_POOL] + [io.KV_POOL] * (len(native) - 1)
    readers = {n.op_type for n in graph.node if io.KV_POOL in n.input}   # nothing else touches the target pool:
    assert readers <= {NATIVE_OP, FUSED_OP}                              # no copy of its history is made
    feeds = example_feeds(step, lengths=(1, 5, 2, 3), cache_lengths=(7, 2, 0, 12), block_size=16, vocab=320, seed=3)
    want = step.run(feeds)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    session = ort.InferenceSession(str(artifacts["eagle3"] / io.ORT_MODEL_NAME), options,
                                   providers=["CPUExecutionProvider"])
    got = session.run(list(step.output_names), {n: feeds[n].numpy() for n in step.input_names})
    for name, value in zip(step.output_names, got):
        assert np.allclose(value, want[name].numpy(), atol=1e-4), name


# --- manifest --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_manifest_describes_the_graph(artifacts: dict[str, Path], checkpoints: dict[str, Path], method: str) -> None:
    path = artifacts[method]
    manifest = Manifest.load(path)
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    step = step_of(method, checkpoints)
    assert (manifest.method, manifest.num_speculative_tokens) == (method, step.k)
    assert (manifest.target_arch, manifest.draft_arch) == ("llama3", "eagle3" if method == "eagle3" else None)
    assert (manifest.vocab_size, manifest.dtype, manifest.block_size) == (320, "float32", 16)
    assert (manifest.max_model_len, manifest.max_batch_size, manifest.max_tokens_per_step) == (2048, 16, 512)
    assert manifest.noise_channels == NOISE_CHANNELS and manifest.structured_output is False
    assert {p.name: (p.num_layers, p.width) for p in manifest.pools} == step.pool_shapes()
    assert all(p.delta == io.DELTA_OF_POOL[p.name] and p.dtype == "float32" for p in manifest.pools)
    assert [t.name for t in manifest.inputs] == list(step.input_names)
    assert [t.name for t in manifest.outputs] == list(step.output_names)

    graph = onnx.load(str(path / io.MODEL_NAME), load_external_data=False).graph
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    specs = {t.name: t for t in manifest.inputs}
    assert list(specs[io.TOKENS].shape) == shapes[io.TOKENS] == ["num_tokens"]
    assert specs[io.DRAFT_TOKENS].shape == ("batch", step.k)
    for pool in manifest.pools:
        assert specs[pool.name].shape == ("num_blocks", pool.num_layers, 16, pool.width)
    custom = sorted({n.op_type for n in graph.node if n.domain == "unispec"})
    assert list(manifest.ops) == custom
    assert set(custom) <= {"PagedAttention", "PagedMLA", "MoE", "SpecAccept", "SampleDraft"}   # DESIGN.md §4
    functions = {(f.domain, f.name) for f in onnx.load(str(path / io.MODEL_NAME), load_external_data=False).functions}
    assert {("unispec", op) for op in custom} <= functions                                # reference bodies kept

    tokenizer = manifest.tokenizer
    assert tokenizer.files == ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (2, 7))
    assert (tokenizer.think_start_id, tokenizer.think_end_id) == (THINK_START, THINK_END)
    assert {"unispec", "torch", "onnx", "onnxscript", "onnxruntime"} <= set(manifest.exporter)
    assert manifest.exporter["torch"] == torch.__version__
    assert manifest.target_checkpoint == str(checkpoints["target"].resolve())       # provenance, absolute
    assert manifest.draft_checkpoint == (str(checkpoints["draft"].resolve()) if method == "eagle3" else None)


def test_read_artifact_refuses_damaged_or_mismatched_dirs(artifacts: dict[str, Path], tmp_path: Path) -> None:
    view = read_artifact(artifacts["none"])
    assert view.manifest == Manifest.load(artifacts["none"]) and view.op_counts["Gemm"] >= 1
    assert all(view.op_counts[f"unispec::{op}"] >= 1 for op in view.manifest.ops)
    with pytest.raises(ArtifactError, match="no manifest.json"):
        read_artifact(tmp_path)
    mismatched = shutil.copytree(artifacts["none"], tmp_path / "mismatched")
    d = json.loads((mismatched / io.MANIFEST_NAME).read_text())
    d["inputs"][0]["shape"] = [7]
    (mismatched / io.MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ArtifactError, match="differ from manifest.json"):
        read_artifact(mismatched)
    artifacts_copy = shutil.copytree(artifacts["none"], tmp_path / "no-weights")
    (artifacts_copy / io.WEIGHTS_NAME).unlink()
    with pytest.raises(ArtifactError, match="model.onnx.data is missing"):
        read_artifact(artifacts_copy)


# --- atomic writes -----------------------------------------------------------------------------------------

def reuse_trace(monkeypatch: pytest.MonkeyPatch, source: Path) -> None:
    """Make `_trace` return an already exported graph: these tests are about the directory handling."""
    def graph(step: torch.nn.Module) -> Path:
        only = source / target_only_files.MODEL_NAME
        return only if step.k == 0 and only.is_file() else source / io.MODEL_NAME   # the target-only trace

    monkeypatch.setattr(artifact, "_trace", lambda step, trace_dir, *_: (
        trace_dir.mkdir(), onnx.load(str(graph(step))))[1])


@pytest.mark.parametrize("stage", ["_trace", "_copy_tokenizer"])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, ExportError])
def test_an_interrupted_export_leaves_no_half_artifact(artifacts: dict[str, Path], checkpoints: dict[str, Path],
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        stage: str, interrupt: type[BaseException]) -> None:
    reuse_trace(monkeypatch, artifacts["none"])
    real = getattr(artifact, stage)

    def interrupted(*args: object) -> object:
        real(*args)                                  # the stage writes its files, then the user hits ^C
        raise interrupt("stop")

    monkeypatch.setattr(artifact, stage, interrupted)
    previous = shutil.copytree(artifacts["none"], tmp_path / "previous")
    before = tree_digest(previous)
    for out in (tmp_path / "fresh", previous):
        with pytest.raises(interrupt):
            export_model(checkpoints["target"], method="none", num_speculative_tokens=0, out_dir=out, progress=False)
    assert not (tmp_path / "fresh").exists()
    assert tree_digest(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]           # no .tmp-/.old- siblings


def test_reexport_replaces_an_existing_artifact(artifacts: dict[str, Path], checkpoints: dict[str, Path],
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = shutil.copytree(artifacts["none"], tmp_path / "art")
    reuse_trace(monkeypatch, artifacts["eagle3"])
    assert export_model(checkpoints["target"], checkpoints["draft"], method="eagle3", num_speculative_tokens=K,
                        out_dir=out, progress=True) == out
    assert Manifest.load(out).method == "eagle3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    onnx.checker.check_model(str(out / io.MODEL_NAME), full_check=True)


def test_export_writes_portable_graphs_and_the_ort_build_lowers_them(artifacts: dict[str, Path],
                                                                     checkpoints: dict[str, Path], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: export/ writes the portable graphs only; engines.ort.build, run on the finished artifact,
    lowers each one the manifest names and records it in the graph map, as `unispec export` has it done."""
    reuse_trace(monkeypatch, artifacts["eagle3"])
    out = artifact.write_artifact(checkpoints["target"], checkpoints["draft"], method="eagle3",
                                num_speculative_tokens=K, out_dir=tmp_path / "art", progress=False)
    assert not list(out.glob("*.ort.onnx"))
    assert Manifest.load(out).graphs == {io.STEP: {io.PORTABLE: io.MODEL_NAME},
                                         io.TARGET_ONLY: {io.PORTABLE: target_only_files.MODEL_NAME}}
    assert ort_build(out) == [io.ORT_MODEL_NAME, lowered_name(target_only_files.MODEL_NAME), io.MANIFEST_NAME]
    assert Manifest.load(out).graphs == Manifest.load(artifacts["eagle3"]).graphs
    ops = lambda p: Counter(n.op_type for n in onnx.load(str(p), load_external_data=False).graph.node)  # noqa: E731
    assert ops(out / io.ORT_MODEL_NAME) == ops(artifacts["eagle3"] / io.ORT_MODEL_NAME)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]          # no temporary file left


def test_a_failing_lowering_leaves_no_half_artifact(artifacts: dict[str, Path], checkpoints: dict[str, Path],
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lowerings run in export's staging directory: one that fails leaves nothing at --out."""
    reuse_trace(monkeypatch, artifacts["none"])

    def broken(directory: Path) -> list[str]:
        (directory / "half.ort.onnx").write_bytes(b"half")
        raise ExportError("the lowering failed")

    with pytest.raises(ExportError, match="the lowering failed"):
        export_model(checkpoints["target"], method="none", num_speculative_tokens=0, out_dir=tmp_path / "art",
                     progress=False, lowerings=(broken,))
    assert not list(tmp_path.iterdir())


def test_refuses_to_replace_a_directory_that_is_not_an_artifact(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not a unispec artifact"):
        export_model(checkpoints["target"], method="none", num_speculative_tokens=0, out_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(("options", "message"), [
    ({"dtype": "int8"}, "--dtype 'int8' is not supported"),
    ({"block_size": 0}, "--block-size must be >= 1"),
    ({"max_tokens_per_step": 4, "max_batch_size": 8}, "--max-tokens-per-step"),
    ({"method": "medusa"}, "unknown method 'medusa'"),
])
def test_bad_options_fail_in_one_line_before_writing(checkpoints: dict[str, Path], tmp_path: Path,
                                                     options: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = {"method": "none", "num_speculative_tokens": 0, "out_dir": tmp_path / "out", **options}
    with pytest.raises(ExportError, match=message) as caught:
        export_model(checkpoints["target"], **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


# --- third-party tools ---------------------------------------------------------------------------------------

def test_polygraphy_inspects_and_runs_an_artifact(artifacts: dict[str, Path], checkpoints: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """`polygraphy inspect model` and `polygraphy run --onnxrt` work on an artifact (valid feeds via a loader)."""
    import subprocess
    import sys

    from export.onnx_export import example_feeds

    feeds = example_feeds(step_of("eagle3", checkpoints), block_size=16, vocab=320, seed=2)
    np.savez(tmp_path / "feeds.npz", **{name: value.numpy() for name, value in feeds.items()})
    loader = tmp_path / "loader.py"
    loader.write_text("import numpy as np\n\ndef load_data():\n"
                      f"    data = np.load({str(tmp_path / 'feeds.npz')!r})\n"
                      "    yield {name: data[name] for name in data.files}\n")
    polygraphy = Path(sys.executable).parent / "polygraphy"
    model = str(artifacts["eagle3"] / io.MODEL_NAME)
    inspected = subprocess.run([str(polygraphy), "inspect", "model", model, "--show", "layers"],
                               capture_output=True, text=True)
    assert inspected.returncode == 0, inspected.stderr
    assert "PagedAttention" in inspected.stdout and "SpecAccept" in inspected.stdout
    ran = subprocess.run([str(polygraphy), "run", model, "--onnxrt", "--data-loader-script", str(loader),
                          "--save-outputs", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "PASSED" in ran.stdout + ran.stderr and (tmp_path / "out.json").is_file()


def test_the_ort_graph_is_inlined_smaller_and_shares_the_weights_file(artifacts: dict[str, Path]) -> None:
    path = artifacts["eagle3"]
    assert Manifest.load(path).graph_file(io.STEP, "ort") == io.ORT_MODEL_NAME
    full = onnx.load(str(path / io.MODEL_NAME), load_external_data=False)
    ort_graph = onnx.load(str(path / io.ORT_MODEL_NAME), load_external_data=False)
    assert not ort_graph.functions and not any(n.domain == "unispec" for n in ort_graph.graph.node)
    bodies = {(f.name, f.overload): len(f.node) for f in full.functions}
    inlined = sum(bodies.get((n.op_type, n.overload), 1) for n in full.graph.node)   # nodes once inlined
    assert len(ort_graph.graph.node) < inlined                  # the optimizer folded some away
    locations = {entry.value for t in ort_graph.graph.initializer for entry in t.external_data
                 if entry.key == "location"}
    assert locations == {io.WEIGHTS_NAME}
    # no weight copied into it: every tensor it holds inline, subgraphs included, is a small constant
    assert largest_inline_tensor(ort_graph.graph) < EXTERNAL_MIN_BYTES
    # SpecAccept's lazy body: the bitmask's unpacking (Mod) and the relaxed verdict's float64 softmax run
    # only inside Ifs, which model.onnx's flat body (TensorRT cannot build those Ifs) runs every step
    flat = [f for f in full.functions if f.name == "SpecAccept"]
    assert flat and all({"Mod", "Softmax"} <= {n.op_type for n in f.node} for f in flat)
    assert not {"Mod", "Softmax"} & {n.op_type for n in ort_graph.graph.node}
    # the speculative math runs as native kernels there (engines/ort/native_ops.py): the verdict and one draft
    # choice per draft step, the same nodes model.onnx has in the unispec domain
    native = Counter(n.op_type for n in ort_graph.graph.node if n.domain == ort_cpu.DOMAIN)
    exported = Counter(n.op_type for n in full.graph.node if n.op_type in ("SpecAccept", "SampleDraft"))
    assert native["SpecAccept"] == exported["SpecAccept"] == 1
    assert native["SampleDraft"] == exported["SampleDraft"] == Manifest.load(path).num_speculative_tokens


def test_the_target_only_graph_is_the_none_graph_over_the_same_weights(artifacts: dict[str, Path]) -> None:
    """Speculative artifacts carry the target-only graph (adaptive speculation): node for node the target's
    `none` graph, every weight a reference into model.onnx.data (nothing stored twice), its own I/O in the
    manifest; `none` artifacts carry none."""
    path, manifest = artifacts["eagle3"], Manifest.load(artifacts["eagle3"])
    only = manifest.target_only
    assert Manifest.load(artifacts["none"]).target_only is None
    files = manifest.graphs[io.TARGET_ONLY]
    assert files == {io.PORTABLE: target_only_files.MODEL_NAME, "ort": lowered_name(target_only_files.MODEL_NAME)}
    assert [t.name for t in only.inputs] == [t.name for t in Manifest.load(artifacts["none"]).inputs]
    assert [t.name for t in only.outputs] == [io.NUM_ACCEPTED, io.NEXT_TOKENS, io.NEXT_DRAFT_TOKENS, io.KV_DELTA,
                                              *io.LOGPROB_OUTPUTS]
    for name in files.values():
        graph = onnx.load(str(path / name), load_external_data=False).graph
        locations = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {io.WEIGHTS_NAME}
    ops = lambda p: sorted(n.op_type for n in onnx.load(str(p), load_external_data=False).graph.node)  # noqa: E731
    assert ops(path / files["ort"]) == ops(artifacts["none"] / io.ORT_MODEL_NAME)
