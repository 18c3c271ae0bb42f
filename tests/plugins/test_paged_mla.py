"""PagedMLA: the reference reproduces DeepSeek's absorbed MLA (export/archs/deepseek_v3/mla.py) bit for bit,
the custom op is the reference, and the exported `unispec::PagedMLA` node runs in ONNX Runtime."""

from __future__ import annotations

import pytest
import torch

from export.archs.deepseek_v3.config import MLAConfig, RopeConfig
from export.archs.deepseek_v3.mla import DeepseekRope, MultiLatentAttention
from plugins.paged_mla.op import paged_mla
from plugins.paged_mla.reference import paged_mla as reference
from tests.plugins.harness import (
    assert_ort_matches,
    assert_plugin_graph,
    attributes,
    export_with_plugins,
    session,
    unispec_nodes,
)

RANK, ROPE = 16, 8


def mla_inputs(seed: int, new: list[int], cached: list[int], *, past: int, heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, b = sum(new), len(new)
    return {
        "q": torch.randn(s, heads, RANK + ROPE, generator=g),
        "latent_new": torch.randn(s, RANK + ROPE, generator=g),
        "past": torch.randn(b, past, RANK + ROPE, generator=g),
        "row_offsets": torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()]),
        "positions": torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]),
        "cache_lengths": torch.tensor(cached),
    }


SMALL = mla_inputs(0, [2, 1, 4], [4, 0, 6], past=8, heads=4)
LARGE = mla_inputs(1, [1, 5, 3, 2], [9, 2, 0, 13], past=16, heads=6)


def test_reference_is_deepseek_absorbed_mla_bit_for_bit() -> None:
    cfg = MLAConfig(hidden_size=32, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=RANK, qk_nope_head_dim=12,
                    qk_rope_head_dim=ROPE, v_head_dim=10, rope=RopeConfig())
    attn = MultiLatentAttention(cfg, absorb=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(7, cfg.hidden_size, generator=g)
    ragged = {k: SMALL[k] for k in ("row_offsets", "positions", "cache_lengths")}
    rope = DeepseekRope(cfg.rope, ROPE)(ragged["positions"])
    want, kv_new = attn(x, SMALL["past"], rope, *ragged.values())

    q_nope, q_pe, latent_new = attn.project(x, *rope)
    w_uk, w_uv = attn._up_weights()
    q = torch.cat([torch.einsum("snd,ndr->snr", q_nope, w_uk), q_pe], dim=-1)        # [S, n, R+Dr]
    out = paged_mla(q, latent_new, SMALL["past"], *ragged.values(), scale=cfg.softmax_scale, kv_lora_rank=RANK)
    got = attn.o_proj(torch.einsum("snr,nvr->snv", out, w_uv).flatten(1))
    assert torch.equal(latent_new, kv_new)
    assert torch.equal(got, want)


@pytest.mark.parametrize("inputs", [SMALL, LARGE], ids=["small", "large"])
def test_eager_op_is_the_reference(inputs) -> None:
    got = paged_mla(*inputs.values(), scale=0.2, kv_lora_rank=RANK)
    assert got.shape == (inputs["q"].shape[0], inputs["q"].shape[1], RANK)
    assert torch.equal(got, reference(*inputs.values(), scale=0.2, kv_lora_rank=RANK))


class Latent(torch.nn.Module):
    def forward(self, q, latent_new, past, row_offsets, positions, cache_lengths):
        return paged_mla(q, latent_new, past, row_offsets, positions, cache_lengths, scale=0.2, kv_lora_rank=RANK)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("paged_mla") / "latent.onnx"
    return export_with_plugins(Latent(), SMALL, path), path


def test_graph_holds_the_node_and_its_function(exported) -> None:
    model, _ = exported
    assert_plugin_graph(model, "PagedMLA", num_nodes=1, num_functions=1)
    attrs = attributes(unispec_nodes(model)[0])
    assert attrs["kv_lora_rank"] == RANK and attrs["scale"] == pytest.approx(0.2)


@pytest.mark.parametrize("inputs", [SMALL, LARGE], ids=["small", "large"])
def test_onnx_runtime_matches_torch(exported, inputs) -> None:
    _, path = exported
    assert_ort_matches(session(path), Latent(), inputs)
