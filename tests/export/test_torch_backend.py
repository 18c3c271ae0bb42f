"""TorchBackend: the torch step behind the runtime's Backend protocol gives the reference loop's tokens
when the runtime Engine drives it, shares its pools with numpy, and refuses checkpoints that do not match
the artifact's manifest in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from export.tiny import write_tiny
from export.torch_backend import TorchBackend
from runtime import manifest as io
from runtime.backend import Backend
from runtime.engine import Engine
from runtime.errors import ArtifactError, ExportError
from runtime.sampling_params import SamplingParams
from tests.engines.manifests import make_manifest
from tests.reference_loop import Request, StepGeometry, generate

MANIFEST = make_manifest()             # the tiny llama3 + eagle3 artifact's manifest: K=3, pools (3, 64), (1, 64)
PROMPTS = [(13, 0.0), (6, 0.8), (21, 0.8)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_tiny(family="llama3", method="eagle3", out_dir=tmp_path_factory.mktemp("ckpt"), seed=0)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, MANIFEST.vocab_size - 1, n).tolist() for n, _ in PROMPTS]


def test_the_engine_over_torch_gives_the_reference_loops_tokens(checkpoints) -> None:
    backend = TorchBackend(MANIFEST, checkpoints["target"], checkpoints["draft"], num_blocks=128)
    assert isinstance(backend, Backend)
    assert [s.name for s in backend.input_specs()] == [t.name for t in MANIFEST.inputs if "pool" not in t.name]
    engine = Engine(backend)
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS, temperature=t, top_p=0.9, seed=i,
                                                ignore_eos=True))
           for i, (p, (_, t)) in enumerate(zip(_prompts(), PROMPTS))]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
    geometry = StepGeometry(k=3, pools=backend.step.pool_shapes(), noise_channels=MANIFEST.noise_channels,
                            block_size=MANIFEST.block_size, num_blocks=128, max_batch=MANIFEST.max_batch_size)
    want = generate(backend.step.run, geometry, [Request(prompt=p, max_new_tokens=NEW_TOKENS, temperature=t,
                                                         top_p=0.9, seed=i)
                                                 for i, (p, (_, t)) in enumerate(zip(_prompts(), PROMPTS))])
    assert [done[i] for i in ids] == [g.tokens for g in want]
    pool = backend.pools[io.KV_POOL]
    assert np.abs(pool).sum() > 0, "commits must land in the pools"
    assert np.shares_memory(pool, backend._pools[io.KV_POOL].numpy())


def test_commit_scatters_the_named_delta_rows(checkpoints) -> None:
    backend = TorchBackend(MANIFEST, checkpoints["target"], checkpoints["draft"], num_blocks=8)
    rng = np.random.default_rng(0)
    outputs = {p.delta: rng.standard_normal((10, p.num_layers, p.width)).astype(np.float32) for p in MANIFEST.pools}
    backend.commit(outputs, slots=np.array([5, 30]), rows=np.array([7, 2]))       # block 1 offset 1, block 7 offset 2
    np.testing.assert_array_equal(backend.pools[io.KV_POOL][1, :, 1], outputs[io.KV_DELTA][7])
    np.testing.assert_array_equal(backend.pools[io.DRAFT_KV_POOL][7, :, 2], outputs[io.DRAFT_KV_DELTA][2])
    assert np.count_nonzero(backend.pools[io.KV_POOL]) == 2 * 3 * 64


def test_checkpoints_of_another_shape_fail_in_one_line(checkpoints) -> None:
    pools = tuple(dataclasses.replace(p, width=32) if p.name == io.KV_POOL else p for p in MANIFEST.pools)
    with pytest.raises(ArtifactError, match="pass the checkpoints the artifact was exported from") as info:
        TorchBackend(dataclasses.replace(MANIFEST, pools=pools), checkpoints["target"], checkpoints["draft"],
                     num_blocks=8)
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match="needs --draft"):
        TorchBackend(MANIFEST, checkpoints["target"], None, num_blocks=8)
