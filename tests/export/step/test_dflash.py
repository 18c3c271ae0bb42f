"""Method `dflash`: Llama 3 target + DFlash block drafter (export/step/block.py, export/archs/dflash/).

Lossless greedy generation and injected drafts for K in {1, 3} (K = block_size - 1, so K = 1 uses a copy
of the tiny draft with block_size 2); every step's drafts and committed draft KV against a dense
re-implementation of z-lab's `DFlashDraftModel` over each row's committed history, with features from
Hugging Face's Llama; the weight adapter's errors; one ONNX export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from export.archs.dflash.config import DFlashConfig
from export.archs.dflash.weights import adapt_dflash
from export.archs.llama3.model import rope_inv_freq
from export.methods import build_step
from export.step.spec_glue import NOISE_CHANNELS
from export.tiny import write_tiny
from export.tiny.targets import VOCAB
from runtime import manifest as io
from runtime.errors import CheckpointError, ExportError
from tests.export.step import harness
from tests.reference_loop import generate


def _variant(src: Path, dst: Path, **edits) -> Path:
    """A copy of a draft checkpoint with config.json fields replaced (dflash_config ones included)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(edits)
    config["dflash_config"].update({k: v for k, v in edits.items() if k in config["dflash_config"]})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash")
    written = write_tiny(family="llama3", method="dflash", out_dir=root / "tiny", seed=0)
    return {"target": written["target"], "draft": written["draft"],
            "block2": _variant(written["draft"], root / "block2", block_size=2),
            "sliding": _variant(written["draft"], root / "sliding", sliding_window=3, use_sliding_window=True,
                                layer_types=["sliding_attention", "full_attention"])}


@pytest.fixture(scope="module")
def steps(dirs):
    return {"none": build_step("none", dirs["target"], k=0),
            1: build_step("dflash", dirs["target"], dirs["block2"], k=1),
            3: build_step("dflash", dirs["target"], dirs["draft"], k=3)}


@pytest.fixture(scope="module")
def baseline(steps):
    return harness.run(steps["none"], steps[3].pool_shapes(), harness.requests(VOCAB), NOISE_CHANNELS)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3])     # K = 1 in `make test-all`
def test_greedy_lossless_and_injected_drafts(steps, k: int) -> None:
    spec = steps[k]
    want = harness.check_lossless(steps["none"], spec, spec.pool_shapes(), VOCAB, NOISE_CHANNELS)
    harness.check_injected_drafts(spec, spec.pool_shapes(), harness.requests(VOCAB), want, NOISE_CHANNELS)


# ---- a dense reference: z-lab's DFlashDraftModel math over one sequence, written from its description -----

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ZLabReference:
    """Context = hidden_norm(fc(target layer outputs)); per layer q from the block, k/v from
    [context, block] with k_norm then RoPE; block = [anchor, mask...] after the committed tokens."""

    def __init__(self, target_dir: Path, draft_dir: Path) -> None:
        from transformers import LlamaForCausalLM

        self.hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.w = load_file(str(draft_dir / "model.safetensors"))
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        c = DFlashConfig.from_hf(self.cfg)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)   # checked vs HF elsewhere
        self.outputs: list[torch.Tensor] = []
        # Hooks, not `output_hidden_states`: transformers' last hidden state is final-normed, taps are not.
        for layer in self.hf.model.layers:
            layer.register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        self.outputs.append(out[0] if isinstance(out, tuple) else out)

    def features(self, tokens: list[int]) -> torch.Tensor:                      # [T, C*H]
        self.outputs.clear()
        with torch.no_grad():
            self.hf(torch.tensor([tokens]))
        return torch.cat([self.outputs[i][0] for i in self.cfg["dflash_config"]["target_layer_ids"]], dim=-1)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:   # x [T, heads, D]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        half = x.shape[-1] // 2
        return x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * angles.sin()

    def _visible(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        kind = (self.cfg.get("layer_types") or ["full_attention"] * 99)[layer]
        causal = self.cfg.get("is_causal")
        causal = kind == "sliding_attention" if causal is None else causal
        ok = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
        if causal:
            ok &= k_pos[None] <= q_pos[:, None]
        if kind == "sliding_attention":
            window = self.cfg["sliding_window"]
            ok &= q_pos[:, None] - k_pos[None] < window
            if not causal:
                ok &= k_pos[None] - q_pos[:, None] < window
        return ok

    def _attention(self, i: int, h: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor):
        w, c, p = self.w, self.cfg, f"layers.{i}.self_attn."
        d, heads, kv_heads = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        n, eps, both = len(ctx), c["rms_norm_eps"], torch.cat([ctx, h])
        q = (h @ w[p + "q_proj.weight"].T).view(len(h), heads, d)
        q = self._rope(_rms(q, w[p + "q_norm.weight"], eps), pos[n:])
        k = (both @ w[p + "k_proj.weight"].T).view(len(both), kv_heads, d)
        k = self._rope(_rms(k, w[p + "k_norm.weight"], eps), pos)
        v = (both @ w[p + "v_proj.weight"].T).view(len(both), kv_heads, d)
        group = heads // kv_heads
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * d ** -0.5
        scores = scores.masked_fill(~self._visible(i, pos[n:], pos), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1)).flatten(1)
        return out @ w[p + "o_proj.weight"].T, torch.cat([k[:n].flatten(1), v[:n].flatten(1)], dim=-1)

    def run(self, tokens: list[int], anchor: int) -> tuple[torch.Tensor, list[int]]:
        """(context K|V [T, Ld, W] of the committed tokens, the block's argmax drafts [bs-1])."""
        w, c = self.w, self.cfg
        eps, block = c["rms_norm_eps"], c["dflash_config"]["block_size"]
        ctx = _rms(self.features(tokens) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)   # [T, H]
        pos = torch.arange(len(tokens) + block)
        embed, head = self.hf.model.embed_tokens.weight.detach(), self.hf.lm_head.weight.detach()
        x = embed[[anchor] + [c["dflash_config"]["mask_token_id"]] * (block - 1)]           # [bs, H]
        rows = []
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            attn, kv = self._attention(i, _rms(x, w[p + "input_layernorm.weight"], eps), ctx, pos)
            rows.append(kv)
            x = x + attn
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        logits = _rms(x, w["norm.weight"], eps)[1:] @ head.T                                 # [bs-1, V]
        return torch.stack(rows, dim=1), logits.argmax(-1).tolist()


class Recorder:
    """Runs the step; for every row checks next_draft_tokens and the draft KV it will hold after the
    commit (pool rows before the step + the committed delta rows) against `ZLabReference`."""

    def __init__(self, step, reference: ZLabReference) -> None:
        self.step, self.ref, self.history, self.rows_checked = step, reference, {}, 0

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.step.run(feeds)
        offsets, cache = feeds["row_offsets"].tolist(), feeds["cache_lengths"].tolist()
        for b, cached in enumerate(cache):
            key = int(feeds["block_table"][b, 0])                   # a live row's first block is its own
            history = [] if cached == 0 else self.history[key]
            assert len(history) == cached
            accepted = int(out["num_accepted"][b])
            committed = history + feeds["tokens"][offsets[b]:offsets[b + 1]].tolist() \
                + feeds["draft_tokens"][b, :accepted].tolist()
            self.history[key] = committed
            chunk = int(feeds["chunk_next_tokens"][b])
            anchor = chunk if chunk >= 0 else int(out["next_tokens"][b])
            want_kv, want_drafts = self.ref.run(committed, anchor)
            pool, table = feeds["draft_kv_pool"], feeds["block_table"][b]
            past = [pool[table[p // pool.shape[2]], :, p % pool.shape[2]] for p in range(cached)]
            start = offsets[b] + b * self.step.k
            new = out["draft_kv_delta"][start:start + len(committed) - cached]
            got_kv = torch.cat([torch.stack(past) if past else new[:0], new])
            assert torch.allclose(got_kv, want_kv, atol=1e-4), (got_kv - want_kv).abs().max()
            assert out["next_draft_tokens"][b].tolist() == want_drafts
            self.rows_checked += 1
        return out


@pytest.mark.parametrize(("draft", "inject"), [("draft", True), ("sliding", False)])
def test_drafts_and_draft_kv_match_dense_zlab_reference(dirs, steps, baseline, draft: str,
                                                        inject: bool) -> None:
    spec = steps[3] if draft == "draft" else build_step("dflash", dirs["target"], dirs[draft], k=3)
    recorder = Recorder(spec, ZLabReference(dirs["target"], dirs[draft]))
    reqs = harness.requests(VOCAB, new_tokens=20)
    if inject:                                  # drafts right at 0, wrong at 1: one accepted, two rejected
        for r, b in zip(reqs, baseline):
            full = r.prompt + b.tokens
            r.injected_drafts = lambda hist, full=full: full[len(hist):len(hist) + 1] + [1, 1]
    geometry = harness.geometry(spec, spec.pool_shapes(), NOISE_CHANNELS, prefill_chunk=8)
    got = generate(recorder, geometry, reqs, harness.zero_noise(NOISE_CHANNELS))
    for g, b in zip(got, baseline):
        assert g.tokens == b.tokens[:20]
        assert not inject or all(a == 1 for a in g.accepted_per_step[:-1])
    assert recorder.rows_checked >= 40


# ---- builder, adapter, export ---------------------------------------------------------------------------

def test_k_must_be_block_size_minus_one(dirs) -> None:
    with pytest.raises(ExportError, match="use --num-speculative-tokens 3, not 2"):
        build_step("dflash", dirs["target"], dirs["draft"], k=2)


def test_non_causal_window_smaller_than_block_is_refused(dirs, tmp_path) -> None:
    draft = _variant(dirs["draft"], tmp_path / "d", sliding_window=2, is_causal=False,
                     layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ExportError, match="layer 0 is non-causal sliding attention"):
        build_step("dflash", dirs["target"], draft, k=3)


def test_io_contract_and_shared_embedding_and_head(steps) -> None:
    spec = steps[3]
    assert spec.output_names == ("num_accepted", "next_tokens", "next_draft_tokens", "next_draft_probs", "kv_delta",
                                 "draft_kv_delta", *io.LOGPROB_OUTPUTS)
    assert "draft_kv_pool" in spec.input_names
    assert spec.pool_shapes() == {"kv_pool": (3, 64), "draft_kv_pool": (2, 2 * 2 * 16)}
    assert spec.drafter.shared_embedding is spec.target.embed_tokens.weight
    assert spec.drafter.shared_head is spec.target.lm_head.weight
    assert spec.target.capture_layers == (0, 1)


def test_adapter_names_missing_and_misshapen_tensors(dirs) -> None:
    source = load_file(str(dirs["draft"] / "model.safetensors"))
    config = DFlashConfig.from_hf(json.loads((dirs["draft"] / "config.json").read_text()))
    state = adapt_dflash(source, config, num_taps=2)
    assert set(state) == set(source) and all(state[k] is source[k] for k in state)
    missing = {k: v for k, v in source.items() if k != "layers.1.self_attn.k_norm.weight"}
    with pytest.raises(CheckpointError, match="'layers.1.self_attn.k_norm.weight' is missing"):
        adapt_dflash(missing, config, num_taps=2)
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \(64, 128\), expected \(64, 192\)"):
        adapt_dflash(source, config, num_taps=3)


def test_step_exports_and_onnxruntime_agrees(steps, tmp_path) -> None:
    import onnx

    path = tmp_path / "dflash.onnx"
    harness.check_onnx_matches_torch(steps[3], path, VOCAB)
    model = onnx.load(str(path))
    vocab_by_hidden = [i.name for i in model.graph.initializer if list(i.dims) == [VOCAB, 64]]
    assert len(vocab_by_hidden) == 2, vocab_by_hidden          # target embedding + lm_head, stored once
