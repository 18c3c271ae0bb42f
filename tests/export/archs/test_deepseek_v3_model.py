"""DeepseekV3Target against transformers' DeepseekV3ForCausalLM through the paged latent pool, and its ONNX export.

A tiny random checkpoint (MLA with and without q_lora, YaRN that changes both the frequencies and the softmax
scale, group-limited MoE with a randomized correction bias) is written with `save_pretrained` (per-expert names
on disk), read back as safetensors, adapted and stepped through prefill + mixed single/multi-token decode steps
with a shuffled block table. Every step is compared with HF run once over each row's whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from export.archs.deepseek_v3.config import DeepseekV3Config
from export.archs.deepseek_v3.model import DeepseekV3Target
from export.archs.deepseek_v3.moe import route
from export.archs.deepseek_v3.weights import adapt_block, adapt_target
from export.checkpoint import Checkpoint, dequantize_fp8_blocks
from export.onnx_export import write_onnx
from export.paged import PagedPools
from runtime.errors import CheckpointError, ExportError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BLOCK_SIZE = 4
TOL = 1e-4
# YaRN over 8 rope channels with original context 16: channel 0 keeps its frequency, 1..3 are divided by
# `factor`; mscale != mscale_all_dim makes the cos/sin factor != 1, and mscale_all_dim rescales the softmax.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
PROMPTS = (7, 10, 3)
# (rows in this step's order, new tokens per row): single-token, multi-token, reordered and partial batches.
DECODE = (((0, 1, 2), (1, 1, 1)), ((2, 0, 1), (3, 1, 2)), ((1, 2), (1, 4)), ((0, 1, 2), (1, 1, 1)),
          ((0, 2, 1), (2, 2, 5)), ((0, 1, 2), (1, 1, 1)), ((2, 1, 0), (1, 3, 1)), ((0, 1, 2), (4, 1, 1)))
CAPTURE = (2, 0)  # unsorted on purpose; layer 2 is the last one, captured before the final norm
INPUTS = ("tokens", "row_offsets", "positions", "cache_lengths", "block_table", "kv_pool")
OUTPUTS = ("logits", "hidden", "captured", "kv_delta")


def tiny_hf_config(q_lora_rank: int | None) -> Any:
    return transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64, rope_scaling=dict(YARN), rms_norm_eps=1e-5, attn_implementation="eager")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations, peaked attention and a routing where the correction bias and the groups matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.15 * noise)
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.3 * torch.rand(bias.shape, generator=g) - 0.15)


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(safetensors_torch.load_file(str(file)))
    return state


class Reference:
    """HF outputs over each row's whole sequence: logits, final hidden, layer outputs, cached latents, routing."""

    def __init__(self, model: Any, seqs: list[torch.Tensor]) -> None:
        self.rows = [self._run(model, s) for s in seqs]

    @staticmethod
    def _run(model: Any, seq: torch.Tensor) -> dict[str, Any]:
        layer_out: dict[int, torch.Tensor] = {}
        routing: list[tuple[torch.Tensor, Any]] = []
        hooks = [layer.register_forward_hook(lambda m, a, o, i=i: layer_out.__setitem__(i, o[0].detach()))
                 for i, layer in enumerate(model.model.layers)]
        hooks += [layer.mlp.gate.register_forward_hook(lambda m, a, o: routing.append((a[0].detach(), o)))
                  for layer in model.model.layers[1:]]
        with torch.no_grad():
            out = model(seq[None], output_hidden_states=True, use_cache=True)
        for hook in hooks:
            hook.remove()
        cache = out.past_key_values.layers
        latents = torch.stack([torch.cat([c.keys[0, 0], c.values[0, 0]], dim=-1) for c in cache], dim=1)
        return {"logits": out.logits[0], "hidden": out.hidden_states[-1][0], "latents": latents,
                "layers": layer_out, "routing": routing}


@functools.cache
def make_checkpoint(q_lora_rank: int | None) -> dict[str, Any]:
    """HF model, its on-disk tensors (save_pretrained -> safetensors) and our config parsed from its config.json."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(tiny_hf_config(q_lora_rank)).eval()
    randomize(hf, seed=1)
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        state = read_safetensors(Path(directory))
        hf_dict = json.loads((Path(directory) / "config.json").read_text())
    return {"hf": hf, "state": state, "config": DeepseekV3Config.from_hf(hf_dict)}


@pytest.fixture(params=[32, None], ids=["q_lora", "no_q_lora"])
def checkpoint(request: pytest.FixtureRequest) -> dict[str, Any]:
    return make_checkpoint(request.param)


def build(ckpt: dict[str, Any], **kwargs: Any) -> DeepseekV3Target:
    model = DeepseekV3Target(ckpt["config"], **kwargs).eval()
    model.load_state_dict(adapt_target(ckpt["state"], ckpt["config"]), strict=True)
    return model


def step_inputs(pools: PagedPools, rows: tuple[int, ...], new: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    cache = pools.cache_lengths(rows)
    lengths = torch.tensor([len(t) for t in new])
    row_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    positions = torch.cat([c + torch.arange(len(t)) for c, t in zip(cache.tolist(), new)])
    return (torch.cat(new), row_offsets, positions, cache, pools.block_table(rows), pools.pools["kv_pool"])


def test_on_disk_names_are_per_expert(checkpoint: dict[str, Any]) -> None:
    state = checkpoint["state"]
    assert state["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert not any(k.endswith("gate_up_proj") for k in state)
    assert "model.layers.0.mlp.gate_proj.weight" in state  # layer 0 is dense


def test_routing_is_group_limited_and_matches_hf(checkpoint: dict[str, Any]) -> None:
    hf, cfg = checkpoint["hf"], checkpoint["config"]
    seq = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    changed, experts_used = 0, set()
    for layer, (_, (logits, weights, indices)) in zip(hf.model.layers[1:], Reference._run(hf, seq)["routing"]):
        bias = layer.mlp.gate.e_score_correction_bias
        ours = route(logits, bias, cfg.moe)                                            # [S, E]
        theirs = torch.zeros_like(ours).scatter(1, indices, weights)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
        ungrouped = (logits.sigmoid() + bias).topk(cfg.moe.num_experts_per_tok, dim=-1).indices
        changed += sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ungrouped, indices))
        experts_used |= set(indices.flatten().tolist())
    assert changed >= 5, "group limiting never changed the selection: the test routing is too easy"
    assert len(experts_used) == cfg.moe.n_routed_experts


def test_paged_steps_match_hf(checkpoint: dict[str, Any]) -> None:
    cfg = checkpoint["config"]
    absorbed = build(checkpoint, num_logits=1, capture_layers=CAPTURE, absorb=True)
    naive = build(checkpoint, num_logits=1, capture_layers=CAPTURE, absorb=False)
    two_logits = build(checkpoint, num_logits=2)
    g = torch.Generator().manual_seed(7)
    totals = [p + sum(n for rows, ns in DECODE for r, n in zip(rows, ns) if r == row) for row, p in enumerate(PROMPTS)]
    seqs = [torch.randint(0, cfg.vocab_size, (t,), generator=g) for t in totals]
    ref = Reference(checkpoint["hf"], seqs).rows
    pools = PagedPools({"kv_pool": (cfg.num_hidden_layers, cfg.kv_width)}, num_blocks=40, block_size=BLOCK_SIZE,
                       seed=11)
    for row in range(len(PROMPTS)):
        pools.add(row)
    schedule = [((0, 1, 2), PROMPTS), *DECODE]
    for rows, counts in schedule:
        starts = pools.cache_lengths(rows).tolist()
        new = [seqs[r][s:s + n] for r, s, n in zip(rows, starts, counts)]
        inputs = step_inputs(pools, rows, new)
        with torch.no_grad():
            logits, hidden, captured, kv_delta = out = absorbed(*inputs)
            for ours, theirs in zip(out, naive(*inputs)):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
            if min(counts) >= 2:
                wide = two_logits(*inputs)[0]                                           # [B, 2, V]
                for b, (r, s, n) in enumerate(zip(rows, starts, counts)):
                    torch.testing.assert_close(wide[b], ref[r]["logits"][s + n - 2:s + n], atol=TOL, rtol=0)
        offsets = inputs[1].tolist()
        for b, (r, s, n) in enumerate(zip(rows, starts, counts)):
            seg, span = slice(offsets[b], offsets[b + 1]), slice(s, s + n)
            torch.testing.assert_close(logits[b, 0], ref[r]["logits"][s + n - 1], atol=TOL, rtol=0)
            torch.testing.assert_close(hidden[seg], ref[r]["hidden"][span], atol=TOL, rtol=0)
            for c, layer in enumerate(CAPTURE):
                torch.testing.assert_close(captured[seg, c], ref[r]["layers"][layer][span], atol=TOL, rtol=0)
            torch.testing.assert_close(kv_delta[seg], ref[r]["latents"][span], atol=1e-5, rtol=0)
        pools.commit(rows, {"kv_pool": kv_delta}, segment_starts=offsets[:-1], counts=list(counts))
    assert pools.cache_lengths((0, 1, 2)).tolist() == totals
    table = pools.block_table((0, 1, 2))
    assert table.flatten().tolist() != sorted(table.flatten().tolist())  # blocks really are shuffled


def test_adapter_reads_one_block_at_any_prefix(checkpoint: dict[str, Any]) -> None:
    cfg, state = checkpoint["config"], checkpoint["state"]
    # Fake an MTP layer at model.layers.3 (a copy of layer 2): the target adapter ignores it ...
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in state.items() if ".layers.2." in k}
    assert adapt_target({**state, **mtp}, cfg).keys() == adapt_target(state, cfg).keys()
    # ... and the block adapter reads it under its prefix as the same block.
    block = adapt_block(mtp, cfg, "model.layers.3", moe=True)
    target = build(checkpoint)
    assert block.keys() == target.layers[2].state_dict().keys()
    for key, tensor in target.layers[2].state_dict().items():
        assert torch.equal(block[key], tensor), key
    no_router = {k: v for k, v in mtp.items() if not k.endswith("mlp.gate.weight")}
    with pytest.raises(CheckpointError, match="'model.layers.3.mlp.gate.weight' is missing"):
        adapt_block(no_router, cfg, "model.layers.3", moe=True)
    bad = {**state, "model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError, match="kv_b_proj.weight' has shape"):
        adapt_target(bad, cfg)


def test_adapter_accepts_fused_experts_and_tied_head(checkpoint: dict[str, Any]) -> None:
    cfg, state = checkpoint["config"], checkpoint["state"]
    per_expert = adapt_block(state, cfg, "model.layers.2", moe=True)
    # transformers' in-memory layout: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    fused = {k: v for k, v in state.items() if ".layers.2.mlp.experts." not in k}
    fused["model.layers.2.mlp.experts.gate_up_proj"] = torch.cat(
        [per_expert["mlp.experts.gate_proj"], per_expert["mlp.experts.up_proj"]], dim=1)
    fused["model.layers.2.mlp.experts.down_proj"] = per_expert["mlp.experts.down_proj"]
    from_fused = adapt_block(fused, cfg, "model.layers.2", moe=True)
    assert from_fused.keys() == per_expert.keys()
    assert all(torch.equal(from_fused[k], per_expert[k]) for k in per_expert)
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(CheckpointError, match="'lm_head.weight' is missing"):
        adapt_target(untied, cfg)
    tied = adapt_target(untied, dataclasses.replace(cfg, tie_word_embeddings=True))
    assert torch.equal(tied["lm_head.weight"], state["model.embed_tokens.weight"])


def test_fp8_checkpoint_flows_through_loader_and_adapter(checkpoint: dict[str, Any], tmp_path) -> None:
    """An FP8 block-quantized checkpoint on disk reaches the adapter dequantized by `Checkpoint`."""
    state = checkpoint["state"]
    key = "model.layers.1.self_attn.kv_b_proj.weight"                                  # [96, 16]
    weight = state[key]
    scale = torch.tensor([[0.5, 2.0], [0.25, 4.0], [1.5, 3.0], [0.75, 1.25]])           # blocks of [32, 8]
    fp8 = (weight / scale.repeat_interleave(32, 0).repeat_interleave(8, 1)).to(torch.float8_e4m3fn)
    expected = dequantize_fp8_blocks(fp8, scale, (32, 8))
    assert (expected - weight).abs().max() < 0.1 * weight.abs().max()               # e4m3 rounding only
    safetensors_torch.save_file({**state, key: fp8, key + "_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    hf_dict = {**checkpoint["hf"].config.to_dict(),
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 8]}}
    (tmp_path / "config.json").write_text(json.dumps(hf_dict))
    adapted = adapt_target(Checkpoint.open(tmp_path), DeepseekV3Config.from_hf(hf_dict))
    assert torch.equal(adapted["layers.1.self_attn.kv_b_proj.weight"], expected)


def test_target_rejects_bad_options(checkpoint: dict[str, Any]) -> None:
    with pytest.raises(ExportError, match="capture_layers"):
        DeepseekV3Target(checkpoint["config"], capture_layers=(3,))
    with pytest.raises(ExportError, match="num_logits"):
        DeepseekV3Target(checkpoint["config"], num_logits=0)


def random_step(cfg: DeepseekV3Config, lengths: list[int], cache_lengths: list[int], *, num_blocks: int,
                max_blocks: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A valid step over a random pool: distinct shuffled blocks per row, positions after each row's cache."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=g)
    row_offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([c + torch.arange(n) for c, n in zip(cache_lengths, lengths)])
    block_table = torch.randperm(num_blocks, generator=g)[: len(lengths) * max_blocks].reshape(len(lengths), -1)
    pool = torch.randn(num_blocks, cfg.num_hidden_layers, BLOCK_SIZE, cfg.kv_width, generator=g)
    return tokens, row_offsets, positions, torch.tensor(cache_lengths), block_table, pool


def test_onnx_export_keeps_dynamic_dims_and_matches_torch(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from torch.export import Dim

    checkpoint = make_checkpoint(32)
    cfg = checkpoint["config"]
    model = build(checkpoint, num_logits=2, capture_layers=(1,))
    example = random_step(cfg, [2, 3, 4], [3, 0, 6], num_blocks=11, max_blocks=3, seed=0)
    s, b, blocks, max_blocks = Dim("num_tokens"), Dim("batch"), Dim("num_blocks"), Dim("max_blocks")
    dynamic = {"tokens": {0: s}, "row_offsets": {0: b + 1}, "positions": {0: s}, "cache_lengths": {0: b},
               "block_table": {0: b, 1: max_blocks}, "kv_pool": {0: blocks}}
    path = tmp_path / "deepseek_v3_step.onnx"
    write_onnx(model, example, path, dynamic_shapes=dynamic,
                      input_names=list(INPUTS), output_names=list(OUTPUTS))

    proto = onnx.load(str(path))
    # Attention (and MoE) are unispec plugin nodes carrying their reference functions (DESIGN.md §4).
    assert {"PagedMLA", "MoE"} <= {n.op_type for n in proto.graph.node if n.domain == "unispec"}
    assert {f.name for f in proto.functions} >= {"PagedMLA", "MoE"}
    assert proto.ir_version == 10
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*proto.graph.input, *proto.graph.output]}
    assert dims["tokens"] == dims["positions"] == ["num_tokens"]
    assert dims["block_table"] == ["batch", "max_blocks"] and dims["cache_lengths"] == ["batch"]
    assert dims["kv_pool"] == ["num_blocks", 3, BLOCK_SIZE, 24]
    assert dims["logits"] == ["batch", 2, 96] and dims["kv_delta"] == ["num_tokens", 3, 24]
    # The pool is read by one plain Gather on the block axis (common.gather_pool);
    # nothing branches on tensor values.
    assert [n.op_type for n in proto.graph.node if "kv_pool" in n.input] == ["Gather"]
    assert not {"Loop", "If", "Scan"} & {n.op_type for n in proto.graph.node}

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for step in (random_step(cfg, [2, 2], [5, 9], num_blocks=9, max_blocks=4, seed=1),
                 random_step(cfg, [3, 2, 5, 2, 4], [0, 7, 2, 13, 1], num_blocks=29, max_blocks=5, seed=2)):
        with torch.no_grad():
            expected = model(*step)
        got = session.run(list(OUTPUTS), {name: t.numpy() for name, t in zip(INPUTS, step)})
        for name, ours, theirs in zip(OUTPUTS, got, expected):
            assert ours.shape == tuple(theirs.shape), name
            torch.testing.assert_close(torch.from_numpy(ours), theirs, atol=TOL, rtol=0, msg=name)
