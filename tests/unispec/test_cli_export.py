"""`unispec export` and `unispec inspect`: one real export (bfloat16, structured output, block 8) and
the one-line refusals, which must fail before anything is written."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner, Result

from export.tiny import write_tiny
from runtime import manifest as io
from runtime.manifest import Manifest
from unispec.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {**write_tiny(family="llama3", method="eagle3", out_dir=root / "eagle3", seed=0),
            "dflash": write_tiny(family="llama3", method="dflash", out_dir=root / "dflash", seed=0)["draft"]}


@pytest.fixture(scope="module")
def bf16_artifact(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    out = tmp_path_factory.mktemp("out") / "bf16"
    result = CliRunner().invoke(main, ["export", "--target", str(tiny["target"]), "--method", "none",
                                       "--out", str(out), "--dtype", "bfloat16", "--structured-output",
                                       "--block-size", "8", "--max-batch-size", "4", "--max-tokens-per-step", "64"])
    return result, out


def one_line_failure(result: Result) -> str:
    """The error's one line; the stage lines of what went well before it (stderr is no terminal) aside."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.exception is not None
    lines = [line for line in result.output.splitlines() if not line.startswith("[export] ")]
    assert len(lines) == 1 and result.stdout == "", result.output
    return lines[0]


def test_export_writes_a_bfloat16_structured_artifact(bf16_artifact: tuple[Result, Path]) -> None:
    result, out = bf16_artifact
    assert result.exit_code == 0, result.output
    assert result.stdout == f"artifact: {out}\n"
    stages = [line.split("  ")[0] for line in result.stderr.splitlines()]    # stderr is no terminal: lines
    assert stages == [f"[export] {stage}" for stage in ("read checkpoints", "built step", "traced step graph",
                                                        "wrote weights", "checked graph", "wrote manifest",
                                                        "backend graphs", "done")]
    onnx.checker.check_model(str(out / io.MODEL_NAME), full_check=True)
    manifest = Manifest.load(out)
    assert (manifest.dtype, manifest.block_size, manifest.structured_output) == ("bfloat16", 8, True)
    assert (manifest.max_batch_size, manifest.max_tokens_per_step, manifest.max_model_len) == (4, 64, 2048)
    assert [(p.name, p.dtype) for p in manifest.pools] == [(io.KV_POOL, "bfloat16")]
    specs = {t.name: t for t in (*manifest.inputs, *manifest.outputs)}
    assert specs[io.KV_POOL].shape == ("num_blocks", 3, 8, 64)
    assert (specs[io.TOKEN_BITMASK].dtype, specs[io.TOKEN_BITMASK].shape) == ("int32", ("batch", 1, 10))  # V=320
    assert specs[io.KV_DELTA].dtype == "bfloat16"
    assert (specs[io.TEMPERATURE].dtype, specs[io.NOISE].dtype) == ("float32", "float32")
    model = onnx.load(str(out / io.MODEL_NAME), load_external_data=False)
    weights = [t for t in model.graph.initializer if t.name.startswith("target.")]   # the module's parameters
    assert len(weights) >= 20 and {t.data_type for t in weights} == {onnx.TensorProto.BFLOAT16}
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)


def test_inspect_prints_manifest_io_and_ops(bf16_artifact: tuple[Result, Path]) -> None:
    _, out = bf16_artifact
    result = CliRunner().invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    manifest = Manifest.load(out)
    for spec in (*manifest.inputs, *manifest.outputs):
        assert spec.name in result.output
    assert "[num_blocks, 3, 8, 64]" in result.output and "bfloat16" in result.output
    assert "none (K = 0)" in result.output and "llama3" in result.output
    assert "ONNX ops:" in result.output and "Gather x" in result.output
    assert all(op in result.output for op in manifest.ops)
    assert result.output.count("attached") == len(manifest.ops) and "missing" not in result.output


def test_inspect_json_matches_the_manifest(bf16_artifact: tuple[Result, Path]) -> None:
    import json

    _, out = bf16_artifact
    result = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    manifest = Manifest.load(out)
    assert document["manifest"] == json.loads(manifest.to_json())
    assert (document["manifest"]["dtype"], document["manifest"]["block_size"]) == ("bfloat16", 8)
    assert document["op_counts"]["Gather"] >= 1
    assert {f"unispec::{op}" for op in manifest.ops} <= set(document["functions"]) and manifest.ops


def test_inspect_refuses_a_damaged_dir_in_one_line(bf16_artifact: tuple[Result, Path], tmp_path: Path) -> None:
    assert "no manifest.json" in one_line_failure(CliRunner().invoke(main, ["inspect", str(tmp_path)]))
    (tmp_path / io.MANIFEST_NAME).write_text("{not json")
    assert "not valid JSON" in one_line_failure(CliRunner().invoke(main, ["inspect", str(tmp_path)]))


@pytest.mark.parametrize(("argv", "message"), [
    (["--method", "mtp"], "method mtp needs a deepseek-v3 target"),
    (["--method", "eagle3"], "method eagle3 needs --draft"),
    (["--method", "eagle3", "--draft", "{draft}", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be >= 1"),
    (["--method", "dflash", "--draft", "{dflash}", "--num-speculative-tokens", "7"], "use --num-speculative-tokens 3"),
    (["--method", "dflash", "--draft", "{draft}"], "needs a dflash draft"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--method", "eagle3", "--draft", "{draft}", "--num-speculative-tokens", "1000"],
     "--num-speculative-tokens 1000 is above unispec's limit of 16 for eagle3"),
    (["--method", "dflash", "--draft", "{dflash}", "--num-speculative-tokens", "32"], "at most 31"),
    (["--max-batch-size", "1000000000"], "--max-batch-size 1000000000 is above unispec's limit of 4096"),
])
def test_bad_combinations_fail_in_one_line_and_write_nothing(tiny: dict[str, Path], tmp_path: Path,
                                                             argv: list[str], message: str) -> None:
    argv = [a.format(draft=tiny["draft"], dflash=tiny["dflash"]) for a in argv]
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--target", str(tiny["target"]), "--out", str(out), *argv])
    assert message in one_line_failure(result)
    assert not list(tmp_path.iterdir())


def test_an_integer_weight_is_refused_by_name(tiny: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(tiny["target"], tmp_path / "int32")
    weights = load_file(target / "model.safetensors")
    key = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[key] = weights[key].to(torch.int32)
    save_file(weights, target / "model.safetensors")
    result = CliRunner().invoke(main, ["export", "--target", str(target), "--out", str(tmp_path / "out")])
    assert f"tensor '{key}' has dtype int32; a weight must be floating point" in one_line_failure(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int32"]


def test_debug_shows_the_traceback(tiny: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--debug", "export", "--target", str(tiny["target"]), "--method", "mtp",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and type(result.exception).__name__ == "ExportError"


def test_export_help_shows_every_option_with_its_default() -> None:
    result = CliRunner().invoke(main, ["export", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for option, default in (("--method", "none"), ("--num-speculative-tokens", "3"), ("--dtype", "float32"),
                            ("--block-size", "16"), ("--max-model-len", "2048"), ("--max-batch-size", "16"),
                            ("--max-tokens-per-step", "512")):
        help_of_option = text.split(f" {option} ", 1)[1].split(" --", 1)[0]
        assert f"[default: {default}]" in help_of_option, option
    for flag in ("--target", "--draft", "--out", "--structured-output"):
        assert flag in text


def test_dtype_auto_reads_the_targets_config(tiny: dict[str, Path], tmp_path: Path) -> None:
    """--dtype auto takes the target's config.json dtype, so one it cannot export is refused by name."""
    import json
    import shutil

    target = shutil.copytree(tiny["target"], tmp_path / "float64")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "dtype": "float64"}))
    result = CliRunner().invoke(main, ["export", "--target", str(target), "--out", str(tmp_path / "out"),
                                       "--dtype", "auto"])
    assert "--dtype auto cannot export field 'dtype' = 'float64'" in one_line_failure(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float64"]
