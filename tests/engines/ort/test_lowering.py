"""engines/ort/lowering.py: which PagedAttention nodes become the in-place kernel, measured by probing the
chain that builds their caches; exported from small torch modules shaped like the real step's attention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import plugins
from engines.ort.lowering import NATIVE_DOMAIN, NATIVE_OP, NATIVE_ROWS_OP, PoolRead, find_pool_reads, lower
from export.archs.common import gather_pool, scatter_rows
from plugins import ort_cpu
from plugins.paged_attention.op import paged_attention
from plugins.paged_mla.op import paged_mla
from runtime import manifest as io

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 4
WIDTH = 2 * HEADS * DIM


class Attention(torch.nn.Module):
    """Layer 1 of a pool read like gather_pool + chunk(2) (K then V); `scatter` times, rows computed in the
    graph are first written into the gathered past (like later draft steps), at positions inside the cached
    past (each time one further on, so the second overwrites part of the first); `one_layer`: layer 1 is
    sliced off first and the rows written into it alone (as Gemma 4's assistant reads its target)."""

    def __init__(self, scatter: int = 0, one_layer: bool = False) -> None:
        super().__init__()
        self.scatter, self.one_layer = scatter, one_layer

    def forward(self, q, k, v, kv_pool, block_table, row_offsets, positions, cache_lengths):
        past = gather_pool(kv_pool, block_table).to(q.dtype)                           # [L, B, P, W]
        if self.one_layer:
            past = past[1:2]                                                            # [1, B, P, W]
        for i in range(self.scatter):
            rows = (torch.cat([k, v], dim=-1).flatten(1) * (i + 2))[:, None, :].expand(-1, past.shape[0], -1)
            past = scatter_rows(past, rows, torch.zeros_like(positions), positions - 3 + i)
        layer = past[0 if self.one_layer else 1]
        k_cache, v_cache = (t.unflatten(-1, (HEADS, DIM)) for t in layer.chunk(2, dim=-1))
        return paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, scale=0.5)


def feeds(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(3, HEADS, DIM, generator=g).to(dtype),
            "k": torch.randn(3, HEADS, DIM, generator=g).to(dtype),
            "v": torch.randn(3, HEADS, DIM, generator=g).to(dtype),
            io.KV_POOL: torch.randn(5, LAYERS, BLOCK, WIDTH, generator=g).to(dtype),
            io.BLOCK_TABLE: torch.tensor([[3, 1]]),
            "row_offsets": torch.tensor([0, 3]),
            "positions": torch.tensor([5, 6, 7]),
            "cache_lengths": torch.tensor([5])}


class Latent(torch.nn.Module):
    """MLA's absorbed attention over layer 1 of a latent pool (rows of R + Dr = WIDTH columns)."""

    def forward(self, q, latent_new, kv_pool, block_table, row_offsets, positions, cache_lengths):
        past = gather_pool(kv_pool, block_table)[1]                                   # [B, P, R+Dr]
        return paged_mla(q, latent_new, past, row_offsets, positions, cache_lengths, scale=0.5, kv_lora_rank=RANK)


RANK = 12


def latent_feeds() -> dict[str, torch.Tensor]:
    inputs = feeds()
    g = torch.Generator().manual_seed(1)
    return {"q": torch.randn(3, HEADS, WIDTH, generator=g), "latent_new": torch.randn(3, WIDTH, generator=g),
            **{name: inputs[name] for name in list(inputs)[3:]}}


def export(module: torch.nn.Module, inputs: dict[str, torch.Tensor], path: Path) -> onnx.ModelProto:
    tokens, blocks, batch, max_blocks = (torch.export.Dim(n) for n in ("num_tokens", "num_blocks", "batch",
                                                                        "max_blocks"))
    per_token = ({0: tokens},) * (len(inputs) - 5)                # q, k, v or q, latent_new
    shapes = (*per_token, {0: blocks}, {0: batch, 1: max_blocks}, {0: batch + 1}, {0: tokens}, {0: batch})
    program = torch.onnx.export(module.eval(), tuple(inputs.values()), dynamo=True, opset_version=24,
                                input_names=list(inputs), dynamic_shapes=shapes,
                                custom_translation_table=plugins.custom_translation_table(), verbose=False)
    plugins.attach_functions_ir(program.model)
    program.save(str(path))
    return onnx.load(str(path))


def test_a_pool_read_is_found_with_its_layer_and_columns(tmp_path: Path) -> None:
    model = export(Attention(), feeds(), tmp_path / "m.onnx")
    assert list(find_pool_reads(model).values()) == [PoolRead(io.KV_POOL, layer=1, k_column=0, v_column=HEADS * DIM)]
    model = export(Latent(), latent_feeds(), tmp_path / "latent.onnx")        # K and V both start at column 0
    assert list(find_pool_reads(model).values()) == [PoolRead(io.KV_POOL, layer=1, k_column=0, v_column=0)]


def test_a_float16_pool_keeps_its_node(tmp_path: Path) -> None:
    assert find_pool_reads(export(Attention(), feeds(torch.float16), tmp_path / "m.onnx")) == {}


@pytest.mark.parametrize("times, one_layer", [(1, False), (2, False), (1, True)])
def test_a_scattered_past_is_found_with_its_in_graph_rows(tmp_path: Path, times: int, one_layer: bool) -> None:
    module = Attention(scatter=times, one_layer=one_layer)
    (read,) = find_pool_reads(export(module, feeds(), tmp_path / "m.onnx")).values()
    assert (read.pool, read.layer, read.k_column, read.v_column) == (io.KV_POOL, 1, 0, HEADS * DIM)
    assert len(read.rows) == len(read.row_index) == times


@pytest.mark.parametrize("module, make_feeds, op", [(Attention(), feeds, NATIVE_OP),
                                                    (Attention(scatter=1), feeds, NATIVE_ROWS_OP),
                                                    (Attention(scatter=2), feeds, NATIVE_ROWS_OP),
                                                    (Attention(scatter=1, one_layer=True), feeds, NATIVE_ROWS_OP),
                                                    (Latent(), latent_feeds, NATIVE_OP)])
def test_the_lowered_graph_computes_what_the_exported_one_does(tmp_path: Path, module, make_feeds, op) -> None:
    inputs = make_feeds()
    model = export(module, inputs, tmp_path / "m.onnx")
    lowered = ir.from_proto(model)
    assert lower(lowered, find_pool_reads(model)) == 1
    native = [n for n in lowered.graph if n.domain == NATIVE_DOMAIN]
    assert [n.op_type for n in native] == [op]
    assert [v.name for v in native[0].inputs][3:5] == [io.KV_POOL, io.BLOCK_TABLE]
    ir.save(lowered, tmp_path / "lowered.onnx")
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    got = ort.InferenceSession(str(tmp_path / "lowered.onnx"), options).run(None, {k: v.numpy() for k, v in
                                                                                   inputs.items()})[0]
    want = module(*inputs.values()).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
