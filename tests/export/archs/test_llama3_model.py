"""Llama3Target against transformers' LlamaForCausalLM through the paged pool, and its ONNX export.

Parity: a tiny random checkpoint is written with `save_pretrained`, read back as safetensors, adapted and
stepped through prefill + mixed single/multi-token decode steps with a shuffled block table; every step is
compared with HF recomputing each row's whole sequence (no HF cache involved).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from export.archs.common import rms_norm
from export.archs.llama3.config import Llama3Config
from export.archs.llama3.model import Llama3Target, rope_inv_freq
from export.archs.llama3.weights import adapt_llama3
from export.onnx_export import write_onnx
from export.paged import PagedPools
from runtime.errors import CheckpointError, ExportError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BLOCK_SIZE = 4
TOL = 1e-4
# original_max_position_embeddings=32 with head_dim 16 exercises all three bands: wavelength 2π is kept
# (< 32/4), 2π·10^0.5 ≈ 19.9 is blended, the six longer ones are divided by `factor`.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
VARIANTS = {
    "plain-untied": dict(rope_parameters=PLAIN_ROPE, tie_word_embeddings=False),
    "plain-tied": dict(rope_parameters=PLAIN_ROPE, tie_word_embeddings=True),
    "llama3-untied": dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "llama3-tied": dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama3-bias": dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False,
                        attention_bias=True, mlp_bias=True),
}
PROMPTS = (5, 9, 14)                       # 2, 3 and 4 blocks of 4
DECODE = ((1, 1, 1), (3, 1, 2), (1, 1, 1), (2, 4, 3), (1, 1, 1), (1, 2, 1), (4, 2, 2), (1, 1, 1), (2, 3, 2))
CAPTURE = (0, 1)


def tiny_hf_config(**overrides: Any) -> Any:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, **overrides)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is peaked and logits are O(1..10), so 1e-4 means something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 2 / p.shape[1] ** 0.5)


def save_checkpoint(path: Path, **overrides: Any) -> Any:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(tiny_hf_config(**overrides)).eval()
    randomize(hf, seed=1)
    hf.save_pretrained(path)
    return hf


def load_target(path: Path, num_logits: int) -> Llama3Target:
    config = Llama3Config.from_hf(json.loads((path / "config.json").read_text()))
    source = safetensors_torch.load_file(path / "model.safetensors")
    return Llama3Target.from_checkpoint(config, source, num_logits=num_logits, capture_layers=CAPTURE)


def ragged(new: list[torch.Tensor], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [S], row_offsets [B+1], positions [S] of one step."""
    counts = torch.tensor([len(t) for t in new])
    row_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, new)])
    return torch.cat(new), row_offsets, positions


def hf_reference(hf: Any, sequence: list[int], count: int, num_logits: int) -> dict[str, torch.Tensor]:
    """HF on the row's whole sequence, cut to its last `count` positions."""
    with torch.no_grad():
        out = hf(torch.tensor([sequence]), output_hidden_states=True, use_cache=True)
    cache = out.past_key_values.layers
    kv = [torch.cat([layer.keys[0, :, -count:].transpose(0, 1).flatten(1),
                     layer.values[0, :, -count:].transpose(0, 1).flatten(1)], dim=-1) for layer in cache]
    states = out.hidden_states    # states[i + 1] = output of layer i, except the last which is normed
    return {"logits": out.logits[0, -num_logits:], "hidden": states[-1][0, -count:],
            "layer0": states[1][0, -count:], "kv": torch.stack(kv, dim=1)}


def check_step(hf: Any, outputs: tuple[torch.Tensor, ...], history: list[list[int]], counts: tuple[int, ...],
               num_logits: int, final_norm: torch.Tensor) -> None:
    logits, hidden, captured, kv_delta = outputs
    start = 0
    for b, count in enumerate(counts):
        seg = slice(start, start + count)
        ref = hf_reference(hf, history[b], count, num_logits)
        torch.testing.assert_close(logits[b], ref["logits"], atol=TOL, rtol=0)
        torch.testing.assert_close(hidden[seg], ref["hidden"], atol=TOL, rtol=0)
        torch.testing.assert_close(captured[seg, 0], ref["layer0"], atol=TOL, rtol=0)
        last_layer_normed = rms_norm(captured[seg, 1], final_norm, 1e-5)     # HF's last state is normed
        torch.testing.assert_close(last_layer_normed, ref["hidden"], atol=TOL, rtol=0)
        torch.testing.assert_close(kv_delta[seg], ref["kv"], atol=TOL, rtol=0)
        start += count


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_paged_steps_match_transformers(variant: str, tmp_path: Path) -> None:
    hf = save_checkpoint(tmp_path, **VARIANTS[variant])
    targets = {n: load_target(tmp_path, n) for n in (1, 2, 3)}
    config = targets[1].config
    pools = PagedPools({"kv_pool": (config.num_hidden_layers, config.kv_width)}, num_blocks=40,
                       block_size=BLOCK_SIZE, seed=3)
    rows = [0, 1, 2]
    for r in rows:
        pools.add(r)
    history: list[list[int]] = [[] for _ in rows]
    g = torch.Generator().manual_seed(7)
    for counts in (PROMPTS, *DECODE):
        new = [torch.randint(0, config.vocab_size, (c,), generator=g) for c in counts]
        tokens, row_offsets, positions = ragged(new, [len(h) for h in history])
        num_logits = min(min(counts), 3)
        with torch.no_grad():
            outputs = targets[num_logits](tokens, row_offsets, positions, pools.cache_lengths(rows),
                                          pools.block_table(rows), pools.pools["kv_pool"])
        assert outputs[0].dtype == torch.float32 and outputs[0].shape == (3, num_logits, config.vocab_size)
        for b, t in enumerate(new):
            history[b] += t.tolist()
        pools.commit(rows, {"kv_pool": outputs[3]}, row_offsets[:-1].tolist(), list(counts))
        check_step(hf, outputs, history, counts, num_logits, targets[1].norm.weight)
    assert pools.cache_lengths(rows).tolist() == [len(h) for h in history]
    tables = [pools.tables[r] for r in rows]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "block tables should be shuffled"


def test_llama3_rope_matches_transformers_and_bites() -> None:
    hf = transformers.LlamaForCausalLM(tiny_hf_config(rope_parameters=LLAMA3_ROPE))
    config = Llama3Config.from_hf(hf.config.to_dict())
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    assert ours[0] == plain[0]                                               # kept
    assert plain[1] / 8 < ours[1] < plain[1]                                 # blended
    torch.testing.assert_close(ours[2:], plain[2:] / 8, rtol=1e-6, atol=0)   # divided by factor


def test_adapter_reports_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, rope_parameters=PLAIN_ROPE)
    config = Llama3Config.from_hf(json.loads((tmp_path / "config.json").read_text()))
    source = safetensors_torch.load_file(tmp_path / "model.safetensors")
    state = adapt_llama3({**source, "model.rotary_emb.inv_freq": torch.zeros(8)}, config)
    Llama3Target(config).load_state_dict(state)          # strict: every parameter mapped, nothing extra
    missing = {k: v for k, v in source.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        adapt_llama3(missing, config)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(63,\), expected \(64,\)"):
        adapt_llama3({**source, "model.norm.weight": torch.ones(63)}, config)


def test_bfloat16_weights_still_give_float32_logits(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, rope_parameters=LLAMA3_ROPE)
    config = Llama3Config.from_hf(json.loads((tmp_path / "config.json").read_text()))
    source = safetensors_torch.load_file(tmp_path / "model.safetensors")
    full = Llama3Target.from_checkpoint(config, source)
    half = Llama3Target.from_checkpoint(config, source, dtype=torch.bfloat16)
    assert half.embed_tokens.weight.dtype == torch.bfloat16 and half.inv_freq.dtype == torch.float32
    tokens, row_offsets, positions = ragged([torch.arange(6), torch.arange(10, 13)], [0, 0])
    pool = torch.zeros(4, config.num_hidden_layers, BLOCK_SIZE, config.kv_width)
    step = (tokens, row_offsets, positions, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64))
    with torch.no_grad():
        reference = full(*step, pool)[0]
        logits, hidden, _, kv_delta = half(*step, pool.bfloat16())
    assert logits.dtype == torch.float32 and hidden.dtype == kv_delta.dtype == torch.bfloat16
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


def test_bad_capture_layers_are_rejected() -> None:
    config = Llama3Config.from_hf(tiny_hf_config().to_dict())
    with pytest.raises(ExportError, match="capture layers \\[2\\] out of range"):
        Llama3Target(config, capture_layers=(0, 2))


INPUTS = ("tokens", "row_offsets", "positions", "cache_lengths", "block_table", "kv_pool")
OUTPUTS = ("logits", "hidden", "captured", "kv_delta")


def random_step(config: Llama3Config, lengths: list[int], cache_lengths: list[int], num_blocks: int,
                max_blocks: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A valid step over a random pool: distinct shuffled blocks per row, positions after each row's cache."""
    g = torch.Generator().manual_seed(seed)
    new = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
    tokens, row_offsets, positions = ragged(new, cache_lengths)
    blocks = torch.randperm(num_blocks, generator=g)[: len(lengths) * max_blocks]
    pool = torch.randn(num_blocks, config.num_hidden_layers, BLOCK_SIZE, config.kv_width, generator=g)
    block_table = blocks.reshape(len(lengths), max_blocks)
    return tokens, row_offsets, positions, torch.tensor(cache_lengths), block_table, pool


def test_onnx_export_keeps_dynamic_dims_and_matches_torch(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from torch.export import Dim

    config = Llama3Config.from_hf(tiny_hf_config(rope_parameters=LLAMA3_ROPE).to_dict())
    model = Llama3Target(config, num_logits=2, capture_layers=(0,)).eval()
    randomize(model, seed=5)
    # Example sizes differ from each other and from every static dim, so no dim gets specialized.
    example = random_step(config, [2, 3, 4], [3, 0, 6], num_blocks=11, max_blocks=3, seed=0)
    s, b, blocks, max_blocks = Dim("num_tokens"), Dim("batch"), Dim("num_blocks"), Dim("max_blocks")
    dynamic = {"tokens": {0: s}, "row_offsets": {0: b + 1}, "positions": {0: s}, "cache_lengths": {0: b},
               "block_table": {0: b, 1: max_blocks}, "kv_pool": {0: blocks}}
    path = tmp_path / "llama3_step.onnx"
    write_onnx(model, example, path, dynamic_shapes=dynamic,
                      input_names=list(INPUTS), output_names=list(OUTPUTS))

    proto = onnx.load(str(path))
    # Attention (and MoE) are unispec plugin nodes carrying their reference functions (DESIGN.md §4).
    assert {"PagedAttention"} <= {n.op_type for n in proto.graph.node if n.domain == "unispec"}
    assert {f.name for f in proto.functions} >= {"PagedAttention"}
    assert proto.ir_version == 10
    assert {(o.domain, o.version) for o in proto.opset_import if o.domain in ("", "ai.onnx")} == {("", 24)}
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*proto.graph.input, *proto.graph.output]}
    assert dims["tokens"] == dims["positions"] == ["num_tokens"]
    assert dims["block_table"] == ["batch", "max_blocks"] and dims["cache_lengths"] == ["batch"]
    assert isinstance(dims["row_offsets"][0], str) and dims["row_offsets"][0] != "batch"
    assert dims["kv_pool"] == ["num_blocks", 2, BLOCK_SIZE, config.kv_width]
    assert dims["logits"] == ["batch", 2, config.vocab_size] and dims["kv_delta"] == ["num_tokens", 2, 64]

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for step in (random_step(config, [2, 2], [5, 9], num_blocks=9, max_blocks=4, seed=1),
                 random_step(config, [3, 2, 5, 2, 4], [0, 7, 2, 13, 1], num_blocks=29, max_blocks=5, seed=2)):
        with torch.no_grad():
            expected = model(*step)
        got = session.run(list(OUTPUTS), {name: t.numpy() for name, t in zip(INPUTS, step)})
        for name, ours, theirs in zip(OUTPUTS, got, expected):
            assert ours.shape == tuple(theirs.shape), name
            torch.testing.assert_close(torch.from_numpy(ours), theirs, atol=TOL, rtol=0, msg=name)
