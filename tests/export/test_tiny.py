"""`export.tiny.write_tiny` / `unispec tiny`: loadable, genuine, consistent, deterministic checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from export.archs import FAMILIES, config_from_hf
from export.checkpoint import Checkpoint
from export.config import read_config_json
from export.tiny import valid_methods, write_tiny
from export.tiny.targets import HIDDEN, NUM_LAYERS, VOCAB
from runtime.errors import ExportError
from unispec.cli import main

ALL_PAIRS = [(family, method) for family in FAMILIES for method in valid_methods(family)]
TARGET_CLASS = {"llama3": "Llama3Config", "deepseek-v3": "DeepseekV3Config", "gemma4": "Gemma4TextConfig"}
DRAFT_CLASS = {"eagle3": "Eagle3Config", "eagle3-mha": "Eagle3Config", "dflash": "DFlashConfig",
               "nextn": "NextNConfig", "gemma4-mtp": "Gemma4AssistantConfig"}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Path]]:
    root = tmp_path_factory.mktemp("tiny")
    return {(f, d): write_tiny(family=f, method=d, out_dir=root / f"{f}-{d}", seed=0) for f, d in ALL_PAIRS}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint.open(path)
    return {key: checkpoint[key] for key in checkpoint}


def parsed(path: Path):
    return config_from_hf(read_config_json(path))


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(("family", "draft"), ALL_PAIRS)
def test_every_pair_writes_loadable_checkpoints(written, family: str, draft: str) -> None:
    paths = written[family, draft]
    assert set(paths) == ({"target", "draft"} if draft in DRAFT_CLASS else {"target"})
    assert type(parsed(paths["target"])).__name__ == TARGET_CLASS[family]
    if "draft" in paths:
        assert type(parsed(paths["draft"])).__name__ == DRAFT_CLASS[draft]
    for path in paths.values():
        weights = tensors(path)
        assert weights and all(bool(torch.isfinite(t.float()).all()) for t in weights.values())
        assert not (path / "generation_config.json").exists() and not list(path.glob("tokenizer*"))


def test_targets_are_genuine_transformers_checkpoints(written) -> None:
    import transformers
    for family, cls in (("llama3", "LlamaForCausalLM"), ("deepseek-v3", "DeepseekV3ForCausalLM"),
                        ("gemma4", "Gemma4ForCausalLM")):
        path = written[family, "none"]["target"]
        model, info = getattr(transformers, cls).from_pretrained(path, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"]
        unexpected = {k for k in info["unexpected_keys"] if not k.startswith(f"model.layers.{NUM_LAYERS}.")}
        assert not unexpected, unexpected        # only DeepSeek's MTP layer is unknown to the HF model
        norm = model.model.norm.weight
        assert not torch.equal(norm, torch.ones_like(norm))  # constant inits were varied


def test_target_does_not_depend_on_the_draft(written) -> None:
    for family in FAMILIES:
        drafts = valid_methods(family)
        first = file_bytes(written[family, "none"]["target"])
        assert all(file_bytes(written[family, d]["target"]) == first for d in drafts)


@pytest.mark.parametrize(("family", "draft"), [("llama3", "eagle3"), ("deepseek-v3", "nextn"),
                                               ("gemma4", "gemma4-mtp")])
def test_same_seed_same_bytes_other_seed_other_bytes(written, tmp_path: Path, family: str,
                                                     draft: str) -> None:
    again = write_tiny(family=family, method=draft, out_dir=tmp_path / "again", seed=0)
    other = write_tiny(family=family, method=draft, out_dir=tmp_path / "other", seed=1)
    for role, path in written[family, draft].items():
        assert file_bytes(again[role]) == file_bytes(path)
        reference, changed = tensors(path), tensors(other[role])
        assert reference.keys() == changed.keys()
        assert any(not torch.equal(reference[k], changed[k]) for k in reference)


def test_mtp_layer_follows_the_official_layout(written) -> None:
    path = written["deepseek-v3", "mtp"]["target"]
    config, weights = read_config_json(path), tensors(path)
    assert config["num_hidden_layers"] == NUM_LAYERS and config["num_nextn_predict_layers"] == 1
    p = f"model.layers.{NUM_LAYERS}."
    assert weights[p + "eh_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)
    for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        assert weights[f"{p}{name}.weight"].shape == (HIDDEN,)
    assert torch.equal(weights[p + "embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert torch.equal(weights[p + "shared_head.head.weight"], weights["lm_head.weight"])
    assert p + "self_attn.kv_a_proj_with_mqa.weight" in weights
    assert weights[p + "mlp.gate.weight"].shape == (8, HIDDEN)               # the MTP block is MoE
    assert p + "mlp.experts.7.down_proj.weight" in weights                   # per-expert names on disk
    assert not any(k.startswith(f"model.layers.{NUM_LAYERS + 1}.") for k in weights)


def test_nextn_is_the_mtp_layer_extracted_sglang_style(written) -> None:
    paths = written["deepseek-v3", "nextn"]
    target, draft = tensors(paths["target"]), tensors(paths["draft"])
    assert {p.name for p in paths["draft"].iterdir()} == {
        "config.json", "nextn_layer_parameters.safetensors", "model.safetensors.index.json"}
    p = f"model.layers.{NUM_LAYERS}."
    expected = {"model.layers.0." + k[len(p):]: t for k, t in target.items()
                if k.startswith(p) and "embed_tokens" not in k and "shared_head.head" not in k}
    assert draft.keys() == expected.keys() and "model.layers.0.eh_proj.weight" in draft
    assert all(torch.equal(draft[k], expected[k]) for k in draft)
    nextn = parsed(paths["draft"])
    assert nextn.base.num_hidden_layers == 1
    nextn.check_target(parsed(paths["target"]))


def test_llama_eagle3_head_matches_its_target(written) -> None:
    paths = written["llama3", "eagle3"]
    weights, head = tensors(paths["draft"]), parsed(paths["draft"])
    target = parsed(paths["target"])
    head.check_target(target)
    assert head.draft_layer == "mha" and head.aux_layer_ids(target.num_hidden_layers) == (0, 1, 2)
    assert weights["fc.weight"].shape == (HIDDEN, 3 * target.hidden_size)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * HIDDEN
    assert "embed_tokens.weight" not in weights                 # the target's embedding is shared
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert weights["lm_head.weight"].shape[0] == d2t.numel() == head.draft_vocab_size < VOCAB
    target_ids = torch.arange(d2t.numel()) + d2t
    assert bool((d2t != 0).any()) and bool((target_ids.diff() > 0).all()) and int(target_ids[-1]) < VOCAB
    assert t2d.numel() == VOCAB and int(t2d.sum()) == d2t.numel() and bool(t2d[target_ids].all())
    mha = tensors(written["llama3", "eagle3-mha"]["draft"])
    assert mha.keys() == weights.keys()                          # eagle3-mha is the same head for Llama


def test_deepseek_eagle3_heads_mla_and_mha(written) -> None:
    mla_paths, mha_paths = written["deepseek-v3", "eagle3"], written["deepseek-v3", "eagle3-mha"]
    target = parsed(mla_paths["target"])
    mla, mla_weights = parsed(mla_paths["draft"]), tensors(mla_paths["draft"])
    mla.check_target(target)
    assert mla.draft_layer == "mla" and not mla.has_vocab_map
    assert {k.split(".")[0] for k in mla_weights} == {"fc", "layers", "norm", "lm_head"}
    assert mla_weights["layers.0.self_attn.q_a_proj.weight"].shape == (32, 2 * HIDDEN)
    assert mla_weights["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (mla.kv_width, 2 * HIDDEN)
    assert mla_weights["lm_head.weight"].shape == (VOCAB, HIDDEN)
    mha, mha_weights = parsed(mha_paths["draft"]), tensors(mha_paths["draft"])
    mha.check_target(target)
    assert mha.draft_layer == "mha" and "layers.0.self_attn.k_proj.weight" in mha_weights
    assert not any(k.startswith("midlayer.") for k in mha_weights)


def test_dflash_draft_matches_its_target(written) -> None:
    paths = written["llama3", "dflash"]
    draft, weights, target = parsed(paths["draft"]), tensors(paths["draft"]), parsed(paths["target"])
    draft.check_target(target)
    taps = draft.target_layer_ids(target.num_hidden_layers)
    assert weights["fc.weight"].shape == (HIDDEN, len(taps) * target.hidden_size) and len(taps) != 3
    assert 0 <= draft.mask_token_id < target.vocab_size and draft.num_draft_tokens == 3
    assert not any("embed_tokens" in k or "lm_head" in k for k in weights)
    assert weights["layers.1.self_attn.k_norm.weight"].shape == (draft.head_dim,)


def test_gemma4_assistant_matches_its_target(written) -> None:
    paths = written["gemma4", "gemma4-mtp"]
    assistant, weights, target = parsed(paths["draft"]), tensors(paths["draft"]), parsed(paths["target"])
    assistant.check_target(target)
    assert weights["pre_projection.weight"].shape == (assistant.hidden_size, 2 * target.hidden_size)
    assert weights["post_projection.weight"].shape == (target.hidden_size, assistant.hidden_size)
    for i in range(assistant.num_hidden_layers):
        q = weights[f"model.layers.{i}.self_attn.q_proj.weight"]
        target_head_dim = target.attention(assistant.layer_types[i]).head_dim
        assert q.shape[0] == assistant.num_attention_heads * target_head_dim
    assert not any("k_proj" in k or "v_proj" in k or "lm_head" in k for k in weights)


def test_rewriting_an_out_dir_leaves_no_stale_weights(tmp_path: Path) -> None:
    write_tiny(family="deepseek-v3", method="nextn", out_dir=tmp_path, seed=0)
    paths = write_tiny(family="deepseek-v3", method="eagle3", out_dir=tmp_path, seed=0)
    assert {p.name for p in paths["draft"].iterdir()} == {"config.json", "model.safetensors"}
    assert "fc.weight" in tensors(paths["draft"])


@pytest.mark.parametrize(("family", "draft"), [("llama3", "mtp"), ("gemma4", "eagle3"),
                                               ("deepseek-v3", "dflash"), ("llama3", "gemma4-mtp")])
def test_invalid_pairs_list_the_valid_methods(tmp_path: Path, family: str, draft: str) -> None:
    with pytest.raises(ExportError) as err:
        write_tiny(family=family, method=draft, out_dir=tmp_path / "x", seed=0)
    message = str(err.value)
    assert "\n" not in message and all(m in message for m in valid_methods(family))
    assert not (tmp_path / "x").exists()
    with pytest.raises(ExportError, match="unknown model family"):
        write_tiny(family="mistral", method="none", out_dir=tmp_path / "x", seed=0)


def test_cli_prints_the_written_paths(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = CliRunner().invoke(main, ["tiny", "--family", "gemma4", "--method", "gemma4-mtp",
                                       "--out", str(out), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"target: {out / 'target'}", f"draft: {out / 'draft'}"]
    assert (out / "target" / "model.safetensors").is_file() and (out / "draft" / "config.json").is_file()
    bad = CliRunner().invoke(main, ["tiny", "--family", "gemma4", "--method", "mtp", "--out", str(out)])
    assert bad.exit_code == 1 and "valid methods for gemma4: none, gemma4-mtp" in bad.output
    assert "Traceback" not in bad.output
