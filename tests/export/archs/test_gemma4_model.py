"""Gemma4Target against transformers' Gemma4ForCausalLM through two paged pools, and its ONNX export.

Parity: a tiny random checkpoint is written with `save_pretrained`, read back as safetensors, adapted and
stepped through prefill + mixed single/multi-token decode steps with shuffled block tables (one pool per
attention type); every step is compared with HF recomputing each row's whole sequence (no HF cache).
Some multi-token steps commit fewer rows than they computed, as a rejected draft would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from export.archs.gemma4.config import FULL, SLIDING, Gemma4TextConfig
from export.archs.gemma4.model import DELTA_NAMES, POOL_NAMES, Gemma4Target, pool_shapes, rope_inv_freq
from export.archs.gemma4.weights import adapt_gemma4
from export.onnx_export import write_onnx
from export.paged import PagedPools
from runtime.errors import CheckpointError, ExportError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BLOCK_SIZE = 4
TOL = 1e-4
WINDOW = 6                                  # shorter than every row after prefill
S, F = "sliding_attention", "full_attention"
VARIANTS = {
    # Layers 4 (sliding) and 5 (full) own no K/V: they read layers 3 and 2. Full layers: k == v, 1 kv head,
    # head dim 32 vs 16; kv-shared layers have a double-wide MLP; per-layer inputs on; tied head, softcap.
    "shared-keqv-ple": dict(layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2, attention_k_eq_v=True,
                            global_head_dim=32, num_global_key_value_heads=1, hidden_size_per_layer_input=8,
                            vocab_size_per_layer_input=96, use_double_wide_mlp=True, final_logit_softcapping=15.0,
                            tie_word_embeddings=True),
    # No sharing, no PLE, untied, no softcap; num_global_key_value_heads is IGNORED by transformers without
    # attention_k_eq_v (full layers keep 2 kv heads); half the full head dim rotates.
    "plain-untied": dict(layer_types=[S, F, S, F], num_kv_shared_layers=0, attention_k_eq_v=False,
                         global_head_dim=24, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                         tie_word_embeddings=False,
                         rope_parameters={S: {"rope_type": "default", "rope_theta": 100.0},
                                          F: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                              "rope_theta": 10_000.0}}),
}
PROMPTS = (7, 13, 10)                      # 2, 4 and 3 blocks of 4
# (new tokens per row, tokens committed per row): multi-token steps sometimes commit fewer.
DECODE = (((1, 1, 1), (1, 1, 1)), ((3, 1, 2), (2, 1, 2)), ((1, 1, 1), (1, 1, 1)), ((2, 4, 3), (2, 1, 3)),
          ((1, 1, 1), (1, 1, 1)), ((4, 2, 2), (4, 2, 1)), ((1, 2, 1), (1, 2, 1)), ((1, 1, 1), (1, 1, 1)),
          ((3, 3, 3), (3, 2, 3)))
CAPTURE = (1, 3)


def tiny_hf_config(layer_types: list[str], **overrides: Any) -> Any:
    return transformers.Gemma4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        max_position_embeddings=256, layer_types=layer_types, attn_implementation="eager", **overrides)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is peaked and logits are O(1..10), so 1e-4 means something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 2 / p.shape[1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def save_checkpoint(path: Path, variant: str) -> Any:
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(tiny_hf_config(**VARIANTS[variant])).eval()
    randomize(hf, seed=1)
    hf.save_pretrained(path)
    return hf


def load_config(path: Path) -> Gemma4TextConfig:
    return Gemma4TextConfig.from_hf(json.loads((path / "config.json").read_text()))


def ragged(new: list[torch.Tensor], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [S], row_offsets [B+1], positions [S] of one step."""
    counts = torch.tensor([len(t) for t in new])
    row_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, new)])
    return torch.cat(new), row_offsets, positions


def hf_reference(hf: Any, sequence: list[int], count: int, num_logits: int) -> dict[str, torch.Tensor]:
    """HF on the row's whole sequence (no cache), cut to its last `count` positions."""
    layer_outputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda _m, _i, out, i=i: layer_outputs.__setitem__(i, out))
             for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            out = hf(torch.tensor([sequence]), output_hidden_states=True, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {"logits": out.logits[0, -num_logits:], "hidden": out.hidden_states[-1][0, -count:],
            "captured": torch.stack([layer_outputs[i][0, -count:] for i in CAPTURE], dim=1)}


def run_schedule(hf: Any, path: Path) -> PagedPools:
    config = load_config(path)
    source = safetensors_torch.load_file(path / "model.safetensors")
    targets = {n: Gemma4Target.from_checkpoint(config, source, num_logits=n, capture_layers=CAPTURE)
               for n in (1, 2, 3)}
    pools = PagedPools(pool_shapes(config), num_blocks=48, block_size=BLOCK_SIZE, seed=3)
    rows = [0, 1, 2]
    for r in rows:
        pools.add(r)
    history: list[list[int]] = [[] for _ in rows]
    g = torch.Generator().manual_seed(7)
    for counts, commits in ((PROMPTS, PROMPTS), *DECODE):
        new = [torch.randint(0, config.vocab_size, (c,), generator=g) for c in counts]
        tokens, row_offsets, positions = ragged(new, [len(h) for h in history])
        num_logits = min(min(counts), 3)
        with torch.no_grad():
            outputs = targets[num_logits](tokens, row_offsets, positions, pools.cache_lengths(rows),
                                          pools.block_table(rows), *(pools.pools[p] for p in Gemma4Target.pool_names))
        check_step(config, hf, outputs, [h + t.tolist() for h, t in zip(history, new)], counts, num_logits)
        history = [h + t[:c].tolist() for h, t, c in zip(history, new, commits)]
        deltas = {POOL_NAMES[SLIDING]: outputs[3], POOL_NAMES[FULL]: outputs[4]}
        pools.commit(rows, deltas, row_offsets[:-1].tolist(), list(commits))
    assert pools.cache_lengths(rows).tolist() == [len(h) for h in history]
    assert min(len(h) for h in history) > 3 * WINDOW
    return pools


def check_step(config: Gemma4TextConfig, hf: Any, outputs: tuple[torch.Tensor, ...], sequences: list[list[int]],
               counts: tuple[int, ...], num_logits: int) -> None:
    logits, hidden, captured, kv_delta, full_kv_delta = outputs
    total = sum(counts)
    assert logits.dtype == torch.float32 and logits.shape == (3, num_logits, config.vocab_size)
    assert hidden.shape == (total, config.hidden_size) and captured.shape == (total, 2, config.hidden_size)
    assert kv_delta.shape == (total, *pool_shapes(config)[POOL_NAMES[SLIDING]])
    assert full_kv_delta.shape == (total, *pool_shapes(config)[POOL_NAMES[FULL]])
    cap = config.final_logit_softcapping
    assert cap is None or logits.abs().max() <= cap
    start = 0
    for b, count in enumerate(counts):
        seg = slice(start, start + count)
        ref = hf_reference(hf, sequences[b], count, num_logits)
        torch.testing.assert_close(logits[b], ref["logits"], atol=TOL, rtol=0)
        torch.testing.assert_close(hidden[seg], ref["hidden"], atol=TOL, rtol=0)
        torch.testing.assert_close(captured[seg], ref["captured"], atol=TOL, rtol=0)
        start += count


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_paged_steps_match_transformers(variant: str, tmp_path: Path) -> None:
    hf = save_checkpoint(tmp_path, variant)
    pools = run_schedule(hf, tmp_path)
    tables = list(pools.tables.values())
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "block tables should be shuffled"


def test_pool_geometry_follows_kv_sharing(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "shared-keqv-ple")
    config = load_config(tmp_path)
    assert config.pool_layers(SLIDING) == (0, 1, 3) and config.pool_layers(FULL) == (2,)
    assert [config.kv_source_layer(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert pool_shapes(config) == {"kv_pool": (3, 2 * 2 * 16), "full_kv_pool": (1, 2 * 1 * 32)}
    target = Gemma4Target(config)
    assert (target.last_sliding_kv_slot, target.last_full_kv_slot) == (2, 0)
    assert DELTA_NAMES == {SLIDING: "kv_delta", FULL: "full_kv_delta"}
    # transformers' own bookkeeping: the "store" layers are exactly our last slots' owners.
    modes = tiny_hf_config(**VARIANTS["shared-keqv-ple"]).kv_sharing_modes
    assert [i for i, m in enumerate(modes) if m == "store"] == sorted((3, 2))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rope_frequencies_equal_transformers(variant: str) -> None:
    hf = transformers.Gemma4ForCausalLM(tiny_hf_config(**VARIANTS[variant]))
    config = Gemma4TextConfig.from_hf(hf.config.to_dict())
    for layer_type in (SLIDING, FULL):
        att = config.attention(layer_type)
        ours = rope_inv_freq(att.rope, att.head_dim)
        assert torch.equal(ours, getattr(hf.model.rotary_emb, f"{layer_type}_inv_freq"))
    full = rope_inv_freq(config.full.rope, config.full.head_dim)
    rotated = int(config.full.rope.partial_rotary_factor * config.full.head_dim // 2)
    assert (full[:rotated] > 0).all() and (full[rotated:] == 0).all() and rotated < len(full)


def test_adapter_reports_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "shared-keqv-ple")
    config = load_config(tmp_path)
    source = safetensors_torch.load_file(tmp_path / "model.safetensors")
    state = adapt_gemma4(source, config)
    assert set(state) == set(Gemma4Target(config).state_dict())
    assert "layers.4.self_attn.k_proj.weight" not in state and "layers.2.self_attn.v_proj.weight" not in state
    missing = {k: v for k, v in source.items() if k != "model.layers.3.self_attn.k_norm.weight"}
    with pytest.raises(CheckpointError, match="'model.layers.3.self_attn.k_norm.weight' is missing"):
        adapt_gemma4(missing, config)
    with pytest.raises(CheckpointError, match=r"'model.layers.5.mlp.up_proj.weight' has shape \(80, 64\), "
                                              r"expected \(160, 64\)"):
        adapt_gemma4({**source, "model.layers.5.mlp.up_proj.weight": torch.zeros(80, 64)}, config)
    # The multimodal checkpoint layout reads the same tensors under model.language_model.
    nested = {k.replace("model.", "model.language_model.", 1): v for k, v in source.items()}
    assert adapt_gemma4(nested, config).keys() == state.keys()


def test_bad_target_arguments_are_rejected(tmp_path: Path) -> None:
    config = Gemma4TextConfig.from_hf(tiny_hf_config(**VARIANTS["plain-untied"]).to_dict())
    with pytest.raises(ExportError, match=r"capture layers \[4\] do not exist"):
        Gemma4Target(config, capture_layers=(0, 4))
    with pytest.raises(ExportError, match="num_logits must be >= 1"):
        Gemma4Target(config, num_logits=0)


# ---- ONNX -------------------------------------------------------------------------------------------

INPUTS = ("tokens", "row_offsets", "positions", "cache_lengths", "block_table", "kv_pool", "full_kv_pool")
OUTPUTS = ("logits", "hidden", "captured", "kv_delta", "full_kv_delta")


def random_step(config: Gemma4TextConfig, lengths: list[int], cache_lengths: list[int], *, num_blocks: int,
                max_blocks: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    new = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
    tokens, row_offsets, positions = ragged(new, cache_lengths)
    blocks = torch.randperm(num_blocks, generator=g)[: len(lengths) * max_blocks]
    pools = [torch.randn(num_blocks, layers, BLOCK_SIZE, width, generator=g)
             for layers, width in pool_shapes(config).values()]
    return (tokens, row_offsets, positions, torch.tensor(cache_lengths), blocks.reshape(len(lengths), max_blocks),
            *pools)


@pytest.mark.slow      # a whole-model torch.export; the gemma4 step graphs are exported and checked in tests/export/step
def test_onnx_export_keeps_dynamic_dims_and_matches_torch(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from torch.export import Dim

    config = Gemma4TextConfig.from_hf(tiny_hf_config(**VARIANTS["shared-keqv-ple"]).to_dict())
    model = Gemma4Target(config, num_logits=2, capture_layers=CAPTURE).eval()
    randomize(model, seed=5)
    assert tuple(pool_shapes(config)) == INPUTS[-2:] and Gemma4Target.pool_names == INPUTS[-2:]
    # Example sizes differ from each other and from every static dim, so no dim gets specialized.
    example = random_step(config, [2, 3, 4], [3, 0, 9], num_blocks=17, max_blocks=5, seed=0)
    s, b, blocks, max_blocks = Dim("num_tokens"), Dim("batch"), Dim("num_blocks"), Dim("max_blocks")
    dynamic = {"tokens": {0: s}, "row_offsets": {0: b + 1}, "positions": {0: s}, "cache_lengths": {0: b},
               "block_table": {0: b, 1: max_blocks}, "kv_pool": {0: blocks}, "full_kv_pool": {0: blocks}}
    path = tmp_path / "gemma4_step.onnx"
    write_onnx(model, example, path, dynamic_shapes=dynamic,
                      input_names=list(INPUTS), output_names=list(OUTPUTS))

    proto = onnx.load(str(path))
    # Attention (and MoE) are unispec plugin nodes carrying their reference functions (DESIGN.md §4).
    assert {"PagedAttention"} <= {n.op_type for n in proto.graph.node if n.domain == "unispec"}
    assert {f.name for f in proto.functions} >= {"PagedAttention"}
    assert proto.ir_version == 10
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*proto.graph.input, *proto.graph.output]}
    assert dims["tokens"] == dims["positions"] == ["num_tokens"]
    assert dims["block_table"] == ["batch", "max_blocks"] and dims["cache_lengths"] == ["batch"]
    assert dims["kv_pool"] == ["num_blocks", 3, BLOCK_SIZE, 64]
    assert dims["full_kv_pool"] == ["num_blocks", 1, BLOCK_SIZE, 64]
    assert dims["logits"] == ["batch", 2, config.vocab_size]
    assert dims["kv_delta"] == ["num_tokens", 3, 64] and dims["full_kv_delta"] == ["num_tokens", 1, 64]

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for step in (random_step(config, [2, 2], [5, 14], num_blocks=9, max_blocks=4, seed=1),
                 random_step(config, [3, 2, 5, 2, 4], [0, 7, 2, 13, 1], num_blocks=29, max_blocks=5, seed=2)):
        with torch.no_grad():
            expected = model(*step)
        got = session.run(list(OUTPUTS), {name: t.numpy() for name, t in zip(INPUTS, step)})
        for name, ours, theirs in zip(OUTPUTS, got, expected):
            assert ours.shape == tuple(theirs.shape), name
            torch.testing.assert_close(torch.from_numpy(ours), theirs, atol=TOL, rtol=0, msg=name)
