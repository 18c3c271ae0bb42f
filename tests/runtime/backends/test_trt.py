"""TrtBackend. CPU: the one-line error without TensorRT, and the CUDA-graph padding contract checked
through ONNX Runtime (padded decode rows leave the real rows' outputs unchanged). `trt` + `gpu`: the
engine against ONNX Runtime on the same feeds, the device commit, the runtime Engine's tokens, and CUDA
graph replays against eager steps; these skip with a reason where TensorRT or a GPU is absent."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from runtime import manifest as io
from runtime.backend import step_bounds
from runtime.backends import load_backend
from runtime.backends.ort import OrtBackend
from runtime.backends.trt import NO_TENSORRT, pad_decode_feeds
from runtime.engine import Engine
from runtime.errors import ArtifactError, BackendUnavailableError, InvalidRequestError
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams

CASE = "llama3-eagle3"
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return tiny_artifact(CASE)


def decode_feeds(manifest: Manifest, batch: int, cache: int = 13, seed: int = 0) -> dict[str, np.ndarray]:
    """One decode step: `batch` rows with `cache` tokens committed each, distinct blocks per row."""
    rng = np.random.default_rng(seed)
    k, bs = manifest.num_speculative_tokens, manifest.block_size
    width = -(-(cache + 1 + 2 * k + 1) // bs)
    bitmask = {io.TOKEN_BITMASK: np.full((batch, k + 1, -(-manifest.vocab_size // 32)), -1, np.int32)}
    q = rng.random((batch, k, manifest.vocab_size), dtype=np.float32) ** 8      # q of sampled drafts
    probs = {io.DRAFT_PROBS: q / q.sum(-1, keepdims=True)} if any(t.name == io.DRAFT_PROBS for t in manifest.inputs) \
        else {}
    return {**(bitmask if manifest.structured_output else {}), **probs,
        io.TOKENS: rng.integers(1, manifest.vocab_size, batch), io.ROW_OFFSETS: np.arange(batch + 1),
        io.POSITIONS: np.full(batch, cache), io.CACHE_LENGTHS: np.full(batch, cache),
        io.BLOCK_TABLE: np.arange(batch * width).reshape(batch, width),
        io.DRAFT_TOKENS: rng.integers(1, manifest.vocab_size, (batch, k)), io.CHUNK_NEXT_TOKENS: np.full(batch, -1),
        io.TEMPERATURE: np.where(np.arange(batch) % 2, 0.8, 0.0).astype(np.float32),
        io.TOP_K: np.zeros(batch, np.int64), io.TOP_P: np.full(batch, 0.9, np.float32),
        io.MIN_P: np.zeros(batch, np.float32), io.IN_THINKING_PHASE: np.zeros(batch, bool),
        io.NOISE: rng.random((batch, k + 1, manifest.noise_channels), dtype=np.float32),
    }


def _fill(pools, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    for pool in pools.values():
        pool[...] = rng.standard_normal(pool.shape, dtype=np.float32) * 0.5


def _assert_prefix_equal(got, want, atol: float) -> None:
    for name, expected in want.items():
        value = np.asarray(got[name])[: expected.shape[0]]
        if expected.dtype.kind in "iub":
            assert np.array_equal(value, expected), name
        else:
            assert np.abs(value - expected).max() <= atol, name


def test_the_engine_flavour_picks_the_module_that_runs_it(monkeypatch) -> None:
    from runtime.backends import trt as trt_module

    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(BackendUnavailableError, match="built with TensorRT-RTX; pip install unispec"):
        trt_module._libs("tensorrt-rtx")
    with pytest.raises(ArtifactError, match="flavour 'tensorrt-13'"):
        trt_module._libs("tensorrt-13")


def test_without_tensorrt_the_backend_says_so_in_one_line(artifact, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailableError) as info:
        load_backend("trt", artifact.path, Manifest.load(artifact.path), num_blocks=NUM_BLOCKS)
    assert str(info.value) == NO_TENSORRT and "\n" not in NO_TENSORRT


@pytest.mark.parametrize("batch, bucket", [(3, 8), (1, 4), (5, 5)])
def test_padded_decode_rows_leave_the_real_rows_outputs_unchanged(artifact, batch: int, bucket: int) -> None:
    manifest = Manifest.load(artifact.path)
    backend = OrtBackend(artifact.path, manifest, num_blocks=NUM_BLOCKS)
    _fill(backend.pools)
    feeds = decode_feeds(manifest, batch)
    want = {n: v.copy() for n, v in backend.run(feeds).items()}
    width = step_bounds(manifest)["max_blocks"]
    padded = pad_decode_feeds(feeds, backend.input_specs(), bucket, width)
    assert padded[io.BLOCK_TABLE].shape == (bucket, width) and padded[io.TOKENS].shape == (bucket,)
    assert padded[io.ROW_OFFSETS].tolist() == list(range(bucket + 1))
    assert (padded[io.DRAFT_TOKENS][batch:] == -1).all() and (padded[io.CACHE_LENGTHS][batch:] == 0).all()
    got = backend.run(padded)
    assert got[io.KV_DELTA].shape[0] == bucket * (1 + manifest.num_speculative_tokens)
    _assert_prefix_equal(got, want, atol=1e-5)


# --- the backend's host logic over a fake TensorRT (CPU) --------------------------------------------------------

@pytest.fixture
def faked(artifact, monkeypatch):
    """(artifact with a pretend engine, fake engine): TrtBackend runs the ONNX graph through ORT."""
    import shutil

    from runtime.backends import trt as trt_module
    from tests.runtime.backends.fake_tensorrt import fake_libs

    manifest = Manifest.load(artifact.path)
    copy = artifact.path.parent / "fake-engine-artifact"
    if not copy.exists():
        shutil.copytree(artifact.path, copy)
    (copy / "engine.plan").write_bytes(b"fake plan")
    manifest = dataclasses.replace(manifest, engine={"plan": "engine.plan", "tensorrt_version": "0.fake",
                                                     "cuda_graph_batches": [1, 2, 4, 8]})
    manifest.write(copy)
    trt, torch, engine = fake_libs(manifest, copy / manifest.model_file)
    monkeypatch.setattr(trt_module, "_libs", lambda flavour="tensorrt": (trt, torch))
    return copy, engine


def test_host_logic_over_a_fake_engine_matches_onnx_runtime(faked) -> None:
    """Persistent buffers bound once, prefix outputs, CUDA-graph buckets with padded decode steps, commits
    of its own outputs (in the tokens pass) and of another backend's (in the lockstep pass)."""
    from runtime.backends.trt import TrtBackend
    from unispec import compare as cmp

    path, engine = faked
    manifest = Manifest.load(path)
    requests = cmp.make_requests(manifest, 5, 14, seed=0)
    blocks = cmp.pool_blocks_for(manifest, requests)
    trt_backend = TrtBackend(path, manifest, num_blocks=blocks)
    report = cmp.compare_backends({"ort": OrtBackend(path, manifest, num_blocks=blocks), "trt": trt_backend},
                                  requests, atol=1e-5, rtol=0.0)
    assert report.passed and report.first_divergence("trt") is None
    graphs = trt_backend._graphs
    assert set(graphs) <= {1, 2, 4, 8} and sum(g.replays for g in graphs.values() if g) >= 10
    (context,) = engine.contexts
    assert set(context.addresses) == set(engine.names)          # every tensor bound, once, at load


def test_engine_mismatches_fail_in_one_line(faked, artifact) -> None:
    from runtime.backends.trt import TrtBackend

    path, _ = faked
    manifest = Manifest.load(path)
    with pytest.raises(InvalidRequestError, match="at most 272 blocks"):
        TrtBackend(path, manifest, num_blocks=273)
    with pytest.raises(ArtifactError, match="built with TensorRT 9.0, this is TensorRT 0.fake"):
        TrtBackend(path, dataclasses.replace(manifest, engine={**manifest.engine, "tensorrt_version": "9.0"}),
                   num_blocks=8)
    with pytest.raises(ArtifactError, match="has no TensorRT engine; run `unispec build"):
        TrtBackend(artifact.path, Manifest.load(artifact.path), num_blocks=8)


# --- TensorRT on a GPU -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(artifact):
    from engines.tensorrt.engine import build_engine

    build_engine(artifact.path, recipe="decode-heavy")
    return artifact


def _trt(built, **options):
    from runtime.backends.trt import TrtBackend

    return TrtBackend(built.path, Manifest.load(built.path), num_blocks=NUM_BLOCKS, **options)


@pytest.mark.trt
@pytest.mark.gpu
def test_engine_equals_onnx_runtime_on_the_same_feeds_and_commits_on_the_device(built) -> None:
    import torch

    trt_backend = _trt(built, cuda_graph_batches=())
    ort_backend = OrtBackend(built.path, trt_backend.manifest, num_blocks=NUM_BLOCKS)
    _fill(ort_backend.pools)
    for name, pool in trt_backend.pools.items():
        assert pool.is_cuda
        pool.copy_(torch.from_numpy(ort_backend.pools[name]))
    for batch in (1, 3, 8):
        feeds = decode_feeds(trt_backend.manifest, batch, seed=batch)
        want = {n: v.copy() for n, v in ort_backend.run(feeds).items()}
        got = trt_backend.run(feeds)
        _assert_prefix_equal(got, want, atol=1e-4)
        slots = np.arange(batch) * 7 + 1
        rows = np.arange(batch) * (1 + trt_backend.manifest.num_speculative_tokens)
        ort_backend.commit(ort_backend.run(feeds), slots, rows)
        trt_backend.commit(trt_backend.run(feeds), slots, rows)
        for name, pool in trt_backend.pools.items():
            np.testing.assert_allclose(pool.cpu().numpy(), ort_backend.pools[name], atol=1e-4, err_msg=name)


def _tokens(backend, n: int = 4) -> list[list[int]]:
    engine = Engine(backend)
    rng = np.random.default_rng(0)
    ids = []
    for i in range(n):
        prompt = rng.integers(1, backend.manifest.vocab_size - 1, 5 + 4 * i).tolist()
        params = SamplingParams(max_tokens=24, ignore_eos=True, seed=i, temperature=0.8 if i % 2 else 0.0)
        ids.append(engine.add_request(prompt, params))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


@pytest.mark.trt
@pytest.mark.gpu
def test_runtime_tokens_equal_onnx_runtime_with_and_without_cuda_graphs(built) -> None:
    want = _tokens(OrtBackend(built.path, Manifest.load(built.path), num_blocks=NUM_BLOCKS))
    assert _tokens(_trt(built, cuda_graph_batches=())) == want
    graphed = _trt(built, cuda_graph_batches=(1, 2, 4, 8))
    assert _tokens(graphed) == want                     # batches shrink as requests finish: buckets alternate
    assert graphed._graphs, "no decode step was captured"
