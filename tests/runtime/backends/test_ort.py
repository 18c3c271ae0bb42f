"""OrtBackend: pools bound once and shared with numpy, the commit rule, step time independent of the
pool size, one-line errors for damaged artifacts, CUDA provider selection (gpu)."""

from __future__ import annotations

import json
import shutil
import statistics
import time

import numpy as np
import pytest

from runtime import manifest as io
from runtime.backend import Backend, PersistentInputBuffers, step_bounds
from runtime.backends.ort import OrtBackend, default_providers
from runtime.errors import ArtifactError
from runtime.manifest import Manifest

CASE = "llama3-eagle3"


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return tiny_artifact(CASE)


def decode_feeds(manifest: Manifest, *, batch: int = 4, cache: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    """A decode step of `batch` rows with `cache` committed tokens each, on blocks 0 .. (fits 64 blocks)."""
    rng = np.random.default_rng(seed)
    k, bs = manifest.num_speculative_tokens, manifest.block_size
    max_blocks = -(-(cache + 1 + 2 * k + 1) // bs)
    bitmask = {io.TOKEN_BITMASK: np.full((batch, k + 1, -(-manifest.vocab_size // 32)), -1, np.int32)} \
        if manifest.structured_output else {}
    if any(t.name == io.DRAFT_PROBS for t in manifest.inputs):   # q of sampled drafts
        q = rng.random((batch, k, manifest.vocab_size), dtype=np.float32) ** 8
        bitmask[io.DRAFT_PROBS] = q / q.sum(-1, keepdims=True)
    return {**bitmask,
        io.TOKENS: rng.integers(1, manifest.vocab_size, batch), io.ROW_OFFSETS: np.arange(batch + 1),
        io.POSITIONS: np.full(batch, cache), io.CACHE_LENGTHS: np.full(batch, cache),
        io.BLOCK_TABLE: np.arange(batch * max_blocks).reshape(batch, max_blocks),
        io.DRAFT_TOKENS: rng.integers(1, manifest.vocab_size, (batch, k)), io.CHUNK_NEXT_TOKENS: np.full(batch, -1),
        io.TEMPERATURE: np.array([0.0, 0.8] * (batch // 2), np.float32), io.TOP_K: np.zeros(batch, np.int64),
        io.TOP_P: np.full(batch, 0.9, np.float32), io.MIN_P: np.zeros(batch, np.float32),
        io.NOISE: rng.random((batch, k + 1, manifest.noise_channels), dtype=np.float32),
        io.IN_THINKING_PHASE: np.zeros(batch, bool),
    }


def _fill_pools(backend: OrtBackend, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    for pool in backend.pools.values():
        pool[...] = rng.standard_normal(pool.shape, dtype=np.float32) * 0.5


def test_outputs_equal_a_plain_session_run_and_pools_stay_in_place(artifact) -> None:
    manifest = Manifest.load(artifact.path)
    backend = OrtBackend(artifact.path, manifest, num_blocks=64)
    addresses = {n: p.ctypes.data for n, p in backend.pools.items()}
    _fill_pools(backend)                               # written after binding: must be what the step reads
    feeds = decode_feeds(manifest)
    got = {n: v.copy() for n, v in backend.run(feeds).items()}
    want = backend.session.run(None, {**feeds, **backend.pools})
    for spec, value in zip(manifest.outputs, want):
        np.testing.assert_allclose(got[spec.name], value, atol=1e-6, err_msg=spec.name)
    assert {n: p.ctypes.data for n, p in backend.pools.items()} == addresses
    assert isinstance(backend, Backend)
    assert [s.name for s in backend.input_specs()] == [s.name for s in manifest.inputs
                                                       if s.name not in backend.pools]


@pytest.mark.parametrize("layout", ["scattered", "runs", "many"])
def test_commit_writes_each_row_at_its_slot_and_the_next_step_sees_it(artifact, layout: str) -> None:
    """Few pairs are written run by run (scattered: runs of one; runs: consecutive slots and rows across a
    block boundary), many by fancy indexing: both must write exactly the commit rule."""
    manifest = Manifest.load(artifact.path)
    backend = OrtBackend(artifact.path, manifest, num_blocks=64)
    feeds = decode_feeds(manifest)
    first = {n: v.copy() for n, v in backend.run(feeds).items()}
    reader = decode_feeds(manifest, cache=2, seed=1)      # each row reads offsets 0, 1 of its first block
    before = backend.run(reader)[io.KV_DELTA].copy()
    bs, width = manifest.block_size, reader[io.BLOCK_TABLE].shape[1]
    slots = [0, width * bs + 1, 2 * width * bs, 64 * bs - 1]     # rows 0, 1, 2 read the first three
    rows = [0, 3, 2, 1]
    if layout == "runs":       # rows 4 .. 7 to the slots either side of block 1's start; rows 9, 12 side by side
        slots, rows = [*slots, bs - 2, bs - 1, bs, bs + 1, bs + 4, bs + 5], [*rows, 4, 5, 6, 7, 9, 12]
    if layout == "many":
        slots, rows = [*slots, *range(3 * width * bs, 3 * width * bs + 40)], [*rows, *(i % 16 for i in range(40))]
    slots, rows = np.array(slots), np.array(rows)
    backend.commit(first, slots, rows)
    for pool in manifest.pools:
        expected = np.zeros_like(backend.pools[pool.name])
        for slot, row in zip(slots, rows):
            expected[slot // bs, :, slot % bs] = first[pool.delta][row]
        assert np.array_equal(backend.pools[pool.name], expected), pool.name
    after = backend.run(reader)[io.KV_DELTA]
    assert not np.allclose(after, before), "the committed rows must change what the step reads"
    want = backend.session.run([io.KV_DELTA], {**reader, **backend.pools})[0]
    np.testing.assert_allclose(after, want, atol=1e-6)


def test_feeds_of_another_dtype_or_layout_are_copied_in(artifact) -> None:
    manifest = Manifest.load(artifact.path)
    backend = OrtBackend(artifact.path, manifest, num_blocks=64)
    feeds = decode_feeds(manifest)
    want = {n: v.copy() for n, v in backend.run(feeds).items()}
    odd = dict(feeds, tokens=feeds[io.TOKENS].astype(np.int32),
               block_table=np.asfortranarray(feeds[io.BLOCK_TABLE]))
    got = backend.run(odd)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


class _CountingBinding:
    """An IOBinding that counts its bind_input calls."""

    def __init__(self, inner, counts: list[int]) -> None:
        self.inner, self.counts, self.index = inner, counts, len(counts)
        counts.append(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def bind_input(self, *args) -> None:
        self.counts[self.index] += 1
        self.inner.bind_input(*args)


def test_a_repeated_step_shape_binds_nothing_and_a_new_shape_gets_its_own_binding(artifact) -> None:
    manifest = Manifest.load(artifact.path)
    backend = OrtBackend(artifact.path, manifest, num_blocks=64)
    _fill_pools(backend)
    session, counts = backend.session, []              # one entry per binding made: its bind_input calls
    make = session.io_binding

    def counted_binding():
        return _CountingBinding(make(), counts)

    session.io_binding = counted_binding
    session.run_with_iobinding = lambda binding, *a: type(session).run_with_iobinding(session, binding.inner, *a)
    buffers = PersistentInputBuffers(backend.input_specs(), step_bounds(manifest))

    def persistent(feeds):                             # the feeds written into the buffers' views, as the engine does
        for name, value in feeds.items():
            buffers.view(name, value.shape)[...] = value
        return {name: buffers.view(name, value.shape) for name, value in feeds.items()}

    def check(feeds):
        got = backend.run(feeds)
        want = session.run(None, {**feeds, **backend.pools})
        for spec, value in zip(manifest.outputs, want):
            np.testing.assert_allclose(got[spec.name], value, atol=1e-6, err_msg=spec.name)

    inputs = len(backend.input_specs())
    check(persistent(decode_feeds(manifest, batch=4)))
    assert counts == [inputs]
    check(persistent(decode_feeds(manifest, batch=4, seed=1)))        # new values, same shape and arrays
    assert counts == [inputs]
    check(persistent(decode_feeds(manifest, batch=2, seed=2)))        # another shape: a binding of its own
    assert counts == [inputs, inputs]
    feeds = persistent(decode_feeds(manifest, batch=4, seed=3))       # back to the first shape: bound already
    check(feeds)
    assert counts == [inputs, inputs]
    check(dict(feeds, tokens=feeds[io.TOKENS].copy()))                # another array: only it is rebound
    assert counts == [inputs + 1, inputs]


def _median_step_times(backends: list[OrtBackend], feeds: dict[str, np.ndarray], repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in backends]
    for _ in range(repeats):                           # interleaved, so load changes hit both alike
        for i, backend in enumerate(backends):
            start = time.perf_counter()
            backend.run(feeds)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def test_step_time_does_not_grow_with_the_pool(artifact) -> None:
    """Pool x64, same feeds: the median step time stays within 1.5x. The ratio of medians is taken over
    several short rounds and their median kept, so a burst of load from other processes, which lands
    on one round, cannot decide it. One intra-op thread: a busy machine makes thread pools jittery."""
    manifest = Manifest.load(artifact.path)
    small = OrtBackend(artifact.path, manifest, num_blocks=64, num_threads=1)
    large = OrtBackend(artifact.path, manifest, num_blocks=64 * 64, num_threads=1)
    feeds = decode_feeds(manifest)
    assert sum(p.nbytes for p in large.pools.values()) >= 16 * 2**20   # a whole-pool copy would show
    _median_step_times([small, large], feeds, repeats=5)               # warm-up
    rounds = [_median_step_times([small, large], feeds, repeats=15) for _ in range(7)]
    ratio = statistics.median(t_large / t_small for t_small, t_large in rounds)
    assert ratio <= 1.5, f"pool x64: step time ratio {ratio:.2f} (medians per round, s: {rounds})"


def _copy(artifact, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(artifact.path, target)
    return target


def _one_line_error(path) -> str:
    with pytest.raises(ArtifactError) as info:
        OrtBackend(path, Manifest.load(path), num_blocks=8)
    message = str(info.value)
    assert "\n" not in message and "re-export" in message
    return message


def test_damaged_artifacts_fail_in_one_line(artifact, tmp_path) -> None:
    path = _copy(artifact, tmp_path)
    graph = Manifest.load(path).graph_file(io.STEP, "ort") or io.MODEL_NAME      # the file ORT runs
    (path / graph).write_bytes(b"not a protobuf at all")
    assert "cannot load" in _one_line_error(path)
    (path / graph).unlink()
    assert graph in _one_line_error(path)
    shutil.copyfile(artifact.path / graph, path / graph)
    d = json.loads((path / io.MANIFEST_NAME).read_text())
    d["outputs"] = d["outputs"][:-1]                   # manifest and graph disagree
    (path / io.MANIFEST_NAME).write_text(json.dumps(d))
    assert "differ" in _one_line_error(path)


def test_a_manifest_of_another_export_is_refused(artifact, tmp_path) -> None:
    """Same names, other geometry (another block size, another dtype): caught when the session opens."""
    for edit in ({"block_size": 8}, {"dtype": "float16"}):
        path = _copy(artifact, tmp_path / next(iter(edit)))
        d = json.loads((path / io.MANIFEST_NAME).read_text())
        for spec in d["inputs"]:
            if spec["name"] == io.KV_POOL:
                if "block_size" in edit:
                    spec["shape"][2] = edit["block_size"]
                else:
                    spec["dtype"] = edit["dtype"]
        for pool in d["pools"]:
            pool["dtype"] = edit.get("dtype", pool["dtype"])
        d.update(edit)
        (path / io.MANIFEST_NAME).write_text(json.dumps(d))
        message = _one_line_error(path)
        assert io.KV_POOL in message and "another export" in message


def test_cpu_is_the_default_without_a_gpu_build() -> None:
    assert default_providers()[-1] == "CPUExecutionProvider"


@pytest.mark.gpu
def test_cuda_provider_comes_first_and_agrees_with_cpu(artifact) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed (the CPU build has no CUDAExecutionProvider)")
    manifest = Manifest.load(artifact.path)
    assert default_providers()[0] == "CUDAExecutionProvider"
    gpu = OrtBackend(artifact.path, manifest, num_blocks=64)
    cpu = OrtBackend(artifact.path, manifest, num_blocks=64, providers=["CPUExecutionProvider"])
    assert gpu.providers[0] == "CUDAExecutionProvider"
    _fill_pools(gpu)
    _fill_pools(cpu)
    feeds = decode_feeds(manifest)
    want = {n: v.copy() for n, v in cpu.run(feeds).items()}
    for name, value in gpu.run(feeds).items():
        np.testing.assert_allclose(value, want[name], atol=1e-4, err_msg=name)


def test_without_a_compiler_the_portable_graph_runs_with_a_warning(artifact, monkeypatch) -> None:
    """model.ort.onnx uses unispec's native CPU kernel; a machine that cannot build it runs model.onnx (the
    same math through ORT's function inlining) and says so, rather than failing."""
    from plugins import ort_cpu

    manifest = Manifest.load(artifact.path)
    native = OrtBackend(artifact.path, manifest, num_blocks=64)
    _fill_pools(native)
    feeds = decode_feeds(manifest)
    want = {n: v.copy() for n, v in native.run(feeds).items()}

    def no_compiler():
        raise ort_cpu.BuildError("no C++ compiler")
    monkeypatch.setattr(ort_cpu, "library_path", no_compiler)
    with pytest.warns(UserWarning, match=f"no C\\+\\+ compiler; running {io.MODEL_NAME} instead"):
        portable = OrtBackend(artifact.path, manifest, num_blocks=64)
    _fill_pools(portable)
    got = portable.run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, atol=1e-5, err_msg=name)
