from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import export.checkpoint as checkpoint_module
from export.checkpoint import Checkpoint, MissingTensorError
from export.config import checkpoint_dtype, resolve_dtype
from runtime.errors import CheckpointError, ConfigError

FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}


def _config(root: Path, **extra: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, **extra}))


def _single(root: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    _config(root, **config)
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _sharded(root: Path, shards: list[dict[str, torch.Tensor]], **config: object) -> list[str]:
    """Shards named as Hugging Face names them, plus the index that maps every key to its shard."""
    _config(root, **config)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, tensors in zip(names, shards):
        save_file(tensors, str(root / name))
        weight_map.update({key: name for key in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


def _three_shards() -> list[dict[str, torch.Tensor]]:
    return [{"embed.weight": torch.randn(6, 4), "layers.0.w": torch.randn(4, 4)},
            {"layers.1.w": torch.randn(4, 4), "layers.1.b": torch.randn(4)},
            {"norm.weight": torch.randn(4), "lm_head.weight": torch.randn(6, 4)}]


def test_single_file_reads_tensors_shapes_and_config(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(4)}
    root = _single(tmp_path / "ck", tensors)
    ckpt = Checkpoint.open(root)
    assert ckpt.path == root and ckpt.config["hidden_size"] == 8
    assert sorted(ckpt) == ["a", "b"] and len(ckpt) == 2 and "a" in ckpt and "zz" not in ckpt
    assert ckpt.shape("a") == (3, 5) and ckpt.dtype_of("b") == torch.int64
    assert torch.equal(ckpt["a"], tensors["a"]) and torch.equal(ckpt["b"], tensors["b"])
    assert ckpt.get("zz") is None  # a Mapping: missing keys are KeyErrors too


def test_sharded_index_reads_every_shard(tmp_path: Path) -> None:
    shards = _three_shards()
    _sharded(tmp_path, shards)
    ckpt = Checkpoint.open(tmp_path)
    expected = {k: v for shard in shards for k, v in shard.items()}
    assert list(ckpt) == list(expected)  # index order
    for key, value in expected.items():
        assert ckpt.shape(key) == tuple(value.shape)
        assert torch.equal(ckpt[key], value)


def test_symlinked_shards_as_in_the_hub_cache(tmp_path: Path) -> None:
    shards = _three_shards()
    names = _sharded(tmp_path / "snapshot", shards)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in names:  # huggingface_hub keeps the files in blobs/ and links them from snapshots/<rev>/
        (tmp_path / "snapshot" / name).rename(blobs / name)
        (tmp_path / "snapshot" / name).symlink_to(Path("..") / "blobs" / name)
    assert torch.equal(Checkpoint.open(tmp_path / "snapshot")["norm.weight"], shards[2]["norm.weight"])


def test_multi_file_without_index_and_duplicate_keys(tmp_path: Path) -> None:
    _config(tmp_path)
    save_file({"fc.weight": torch.randn(4, 8)}, str(tmp_path / "eagle_fc.safetensors"))
    save_file({"midlayer.w": torch.randn(4, 4), "d2t": torch.arange(5)}, str(tmp_path / "head.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    assert set(ckpt) == {"fc.weight", "midlayer.w", "d2t"}
    assert ckpt["d2t"].tolist() == [0, 1, 2, 3, 4] and ckpt.shape("fc.weight") == (4, 8)

    save_file({"d2t": torch.arange(5)}, str(tmp_path / "zz_copy.safetensors"))
    with pytest.raises(CheckpointError, match=r"'d2t'.*head\.safetensors.*zz_copy\.safetensors"):
        Checkpoint.open(tmp_path)


def test_model_safetensors_wins_over_extra_copies(tmp_path: Path) -> None:
    root = _single(tmp_path, {"w": torch.ones(2)})
    save_file({"w": torch.zeros(2)}, str(root / "consolidated.safetensors"))
    assert Checkpoint.open(root)["w"].tolist() == [1.0, 1.0]


def test_dtype_casts_floats_only(tmp_path: Path) -> None:
    weight = torch.randn(4, 6).bfloat16()
    root = _single(tmp_path, {"w": weight, "d2t": torch.arange(7), "t2d": torch.tensor([True, False])})
    ckpt = Checkpoint.open(root, dtype=torch.float32)
    assert ckpt.dtype_of("w") == torch.float32 and ckpt["w"].dtype == torch.float32
    assert torch.equal(ckpt["w"], weight.float())
    assert ckpt["d2t"].dtype == torch.int64 and ckpt["d2t"].tolist() == list(range(7))
    assert ckpt.dtype_of("t2d") == torch.bool and ckpt["t2d"].tolist() == [True, False]
    assert Checkpoint.open(root)["w"].dtype == torch.bfloat16  # dtype=None keeps what is on disk
    with pytest.raises(CheckpointError, match="floating"):
        Checkpoint.open(root, dtype=torch.int32)


def test_files_open_lazily_and_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = checkpoint_module.safe_open

    def counting_open(path: str, **kwargs: object) -> object:
        opened.append(Path(path).name)
        return real_open(path, **kwargs)

    monkeypatch.setattr(checkpoint_module, "safe_open", counting_open)
    shards = _three_shards()
    names = _sharded(tmp_path, shards)
    damaged = tmp_path / names[2]
    damaged.write_bytes(damaged.read_bytes()[:-16])  # the third shard's data region is cut short
    ckpt = Checkpoint.open(tmp_path)
    assert opened == []  # the index alone gives the keys: no file is touched at open time
    assert torch.equal(ckpt["embed.weight"], shards[0]["embed.weight"])
    assert torch.equal(ckpt["layers.0.w"], shards[0]["layers.0.w"])
    assert ckpt.shape("layers.1.b") == (4,)
    assert torch.equal(ckpt["layers.1.b"], shards[1]["layers.1.b"])
    assert opened == names[:2]  # each file opened once, on first use, and kept open
    with pytest.raises(CheckpointError, match=rf"{names[2]}.*'norm\.weight'"):
        ckpt["norm.weight"]


def test_with_prefix_strips_and_stays_lazy(tmp_path: Path) -> None:
    tensors = {"model.layers.2.eh_proj.weight": torch.randn(4, 8), "model.layers.2.enorm.weight": torch.randn(4),
               "model.layers.20.enorm.weight": torch.randn(4), "model.layers.1.x": torch.randn(2)}
    ckpt = Checkpoint.open(_single(tmp_path, tensors), dtype=torch.float64)
    mtp = ckpt.with_prefix("model.layers.2.")
    assert sorted(mtp) == ["eh_proj.weight", "enorm.weight"] and len(mtp) == 2 and "x" not in mtp
    assert mtp.shape("eh_proj.weight") == (4, 8) and mtp.config is ckpt.config
    assert torch.equal(mtp["enorm.weight"], tensors["model.layers.2.enorm.weight"].double())
    assert list(mtp.with_prefix("eh_proj.")) == ["weight"]
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.2\.nope'"):
        mtp["nope"]


def _fp8_reference(fp8_bytes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Dequantize with ml_dtypes and explicit block loops: independent of the loader's broadcasting."""
    out = fp8_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = out[rows, cols] * scale[i, j]
    return out


@pytest.mark.parametrize(("shape", "block"), [((300, 200), (128, 128)), ((5, 7), (2, 3))])
def test_fp8_dequantization_is_exact(tmp_path: Path, shape: tuple[int, int], block: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=gen) * 8).to(torch.float8_e4m3fn)
    blocks = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.rand(blocks, generator=gen) * 0.01 + 1e-4                       # [ceil(R/br), ceil(C/bc)]
    norm = torch.randn(shape[1]).bfloat16()
    config = {"quantization_config": {**FP8_CONFIG["quantization_config"], "weight_block_size": list(block)}}
    # the scale sits in another shard than its weight, as in DeepSeek-V3's own index
    _sharded(tmp_path, [{"q.weight": weight, "norm.weight": norm}, {"q.weight_scale_inv": scale}], **config)
    expected = _fp8_reference(weight.view(torch.uint8).numpy(), scale.numpy(), block)

    ckpt = Checkpoint.open(tmp_path)
    assert sorted(ckpt) == ["norm.weight", "q.weight"] and "q.weight_scale_inv" not in ckpt
    assert ckpt.dtype_of("q.weight") == torch.float32 and ckpt["norm.weight"].dtype == torch.bfloat16
    assert np.array_equal(ckpt["q.weight"].numpy(), expected)
    as_bf16 = Checkpoint.open(tmp_path, dtype=torch.bfloat16)["q.weight"]
    assert torch.equal(as_bf16, torch.from_numpy(expected).bfloat16())
    with pytest.raises(MissingTensorError, match=r"'q\.weight_scale_inv'.*'q\.weight'"):
        ckpt["q.weight_scale_inv"]


def test_fp8_without_or_with_misshapen_scale_names_the_key(tmp_path: Path) -> None:
    weight = torch.randn(130, 4).to(torch.float8_e4m3fn)
    ckpt = Checkpoint.open(_single(tmp_path / "a", {"lonely.weight": weight}, **FP8_CONFIG))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: FP8 tensor 'lonely\.weight'.*_scale_inv"):
        ckpt["lonely.weight"]
    bad = {"w.weight": weight, "w.weight_scale_inv": torch.ones(1, 1)}  # needs [2, 1] for 130 rows
    ckpt = Checkpoint.open(_single(tmp_path / "b", bad, **FP8_CONFIG))
    with pytest.raises(CheckpointError, match=r"'w\.weight'.*\[2, 1\]"):
        ckpt["w.weight"]


def test_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    _config(tmp_path)
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin") as err:
        Checkpoint.open(tmp_path)
    message = str(err.value)
    assert "arbitrary code" in message and "safetensors.torch.save_file" in message and "\n" not in message


def test_no_weights_at_all(tmp_path: Path) -> None:
    _config(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no \*\.safetensors"):
        Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint.open(tmp_path / "absent")


def test_missing_key_names_key_and_files_searched(tmp_path: Path) -> None:
    names = _sharded(tmp_path, _three_shards())
    ckpt = Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match=r"'layers\.9\.w'") as err:
        ckpt["layers.9.w"]
    assert isinstance(err.value, KeyError) and all(name in str(err.value) for name in names)
    with pytest.raises(CheckpointError, match=r"'layers\.9\.w'"):
        ckpt.shape("layers.9.w")


def test_index_key_absent_from_its_shard(tmp_path: Path) -> None:
    names = _sharded(tmp_path, _three_shards())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = names[1]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{names[1]}: cannot read tensor 'ghost'"):
        Checkpoint.open(tmp_path)["ghost"]


def _rewrite(path: Path, edit) -> None:
    path.write_bytes(edit(path.read_bytes()))


def test_truncated_file(tmp_path: Path) -> None:
    root = _single(tmp_path, {"w": torch.randn(8, 8)})
    _rewrite(root / "model.safetensors", lambda data: data[:-40])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        Checkpoint.open(root)


def test_corrupt_header(tmp_path: Path) -> None:
    root = _single(tmp_path, {"w": torch.randn(8, 8)})
    _rewrite(root / "model.safetensors", lambda data: data[:8] + b"#" * 12 + data[20:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*JSON"):
        Checkpoint.open(root)


def test_header_promising_more_bytes_than_the_file_has(tmp_path: Path) -> None:
    root = _single(tmp_path, {"w": torch.randn(8, 8)})
    _rewrite(root / "model.safetensors", lambda data: (len(data) + 64).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*header length"):
        Checkpoint.open(root)


def test_missing_shard_file(tmp_path: Path) -> None:
    names = _sharded(tmp_path, _three_shards())
    (tmp_path / names[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json: shard file '{names[1]}' \(holding 'layers\.1\.w'\)"):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": {"a": "x", "a": "y"}}',
                                  '{"weight_map": {"a": "../model-00001-of-00003.safetensors"}}'])
def test_bad_index(tmp_path: Path, text: str) -> None:
    _sharded(tmp_path, _three_shards())
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: "):
        Checkpoint.open(tmp_path)


def test_missing_config_json(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="config.json"):
        Checkpoint.open(tmp_path)


# --- `--dtype auto`: the checkpoint's own dtype (export/config.py) --------------------------------------------

@pytest.mark.parametrize(("config", "dtype"), [
    ({"torch_dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
    ({"torch_dtype": "float32"}, "float32"), ({"dtype": "bfloat16"}, "bfloat16"),       # transformers >= 4.56
    ({"dtype": "float16", "torch_dtype": "float32"}, "float16"), ({"torch_dtype": "torch.float16"}, "float16"),
    ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"), ({}, "float32"), ({"torch_dtype": None}, "float32"),
    ({**FP8_CONFIG, "torch_dtype": "bfloat16"}, "bfloat16"),          # FP8: the dtype it was quantized from
    ({**FP8_CONFIG, "torch_dtype": "float8_e4m3fn"}, "bfloat16"), ({**FP8_CONFIG}, "float32"),
])
def test_dtype_auto_reads_the_config_dtype(config: dict, dtype: str) -> None:
    assert checkpoint_dtype(config) == dtype


def test_dtype_auto_refuses_a_dtype_it_cannot_export(tmp_path: Path) -> None:
    _config(tmp_path, torch_dtype="float64")
    with pytest.raises(ConfigError, match=r"config\.json: --dtype auto cannot export field 'torch_dtype' = "
                                          r"'float64'; pass --dtype float32"):
        resolve_dtype("auto", tmp_path)


def test_resolve_dtype_reads_config_only_for_auto(tmp_path: Path) -> None:
    _config(tmp_path, torch_dtype="bfloat16")
    assert resolve_dtype("auto", tmp_path) == "bfloat16"
    assert resolve_dtype("float16", tmp_path / "absent") == "float16"      # an explicit dtype reads nothing
