"""What the commands print: no other package's warnings, export's stage lines off a terminal, `-q` / `-v`,
and `run --json` (inspect, build and compare have theirs in test_cli_export.py, test_cli_build.py and
test_cli_compare.py)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from unispec.cli import main

# what a line from torch, onnxscript, onnx_ir or Python's warnings machinery carries
FOREIGN = ("Warning", "torchvision", "Skipped deduplication", "FutureWarning", "UserWarning")


@pytest.fixture(scope="module")
def artifact(tiny_artifact_of) -> Path:
    return tiny_artifact_of("llama3-none", "float32")


@pytest.mark.slow
def test_export_in_a_subprocess_prints_stage_lines_and_nothing_of_other_packages(tmp_path: Path) -> None:
    """A real `unispec export` with stderr a pipe (as in `make demo > log`): stage lines with seconds, the
    result line on stdout, and not one line of torch.onnx / onnx_ir / warnings."""
    from export.tiny import write_tiny

    target = write_tiny(family="llama3", method="none", out_dir=tmp_path / "tiny", seed=0)["target"]
    out = tmp_path / "art"
    done = subprocess.run([sys.executable, "-m", "unispec.cli", "export", "--target", str(target), "--out", str(out),
                           "--max-batch-size", "4", "--max-tokens-per-step", "64"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"artifact: {out}\n"
    lines = done.stderr.splitlines()
    assert not [line for line in lines if any(word in line for word in FOREIGN)], done.stderr
    # a stage's seconds, then what it says of itself, if anything (a deep target's trace: the layers it traced)
    assert all(re.fullmatch(r"\[export\] .+ +\d+\.\d s(  \(.+\))?", line) for line in lines), done.stderr
    assert [line.split("  ")[0].removeprefix("[export] ") for line in lines] == [
        "read checkpoints", "built step", "traced step graph", "wrote weights", "checked graph",
        "wrote manifest", "backend graphs", "done"]


def test_quiet_exporter_holds_back_the_exporters_lines_until_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    import torch  # noqa: F401  (torch's logging setup: the "torch" logger's own level and handler, as in an export)

    from export.onnx_files import quiet_exporter

    def noise() -> None:
        logging.getLogger("torch.onnx._internal.exporter._registration").warning(
            "torchvision is not installed. Skipping torchvision::nms")
        logging.getLogger("onnx_ir.passes.common.initializer_deduplication").warning("Skipped deduplication of x")
        warnings.warn("a FutureWarning of torch.export", FutureWarning, stacklevel=1)

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_exporter():
            noise()
        assert caplog.records == [] and caught == []
        noise()                                      # every level and filter is back once it ends
    assert [r.name.split(".")[0] for r in caplog.records] == ["torch", "onnx_ir"]
    assert [w.category for w in caught] == [FutureWarning]


def test_export_stages_are_lines_with_seconds_when_stderr_is_not_a_terminal(capsys) -> None:
    from export.progress import Stages as _Stages

    with _Stages(None) as stages:                    # pytest's stderr is no terminal
        stages.start("read checkpoints")
        stages.start("trace + export")
        stages.note("4 of 8 target layers traced, the rest stamped")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["[export] read checkpoints", "[export] traced step graph",
                                                      "[export] done"]
    assert lines[1].endswith(" s  (4 of 8 target layers traced, the rest stamped)")
    assert all(float(re.search(r"(\d+\.\d) s", line)[1]) >= 0 for line in lines)
    assert lines[0].endswith(" s") and lines[2].endswith(" s")
    with _Stages(False) as stages:
        stages.start("read checkpoints")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("flags", "progress"), [([], None), (["-q"], False), (["-v"], "lines")])
def test_q_and_v_set_exports_progress(monkeypatch, tmp_path: Path, flags: list[str], progress: object) -> None:
    import export.artifact

    seen = {}

    def fake_export(**options: object) -> Path:
        seen.update(options)
        return tmp_path / "art"

    monkeypatch.setattr(export.artifact, "write_artifact", fake_export)
    result = CliRunner().invoke(main, [*flags, "export", "--target", str(tmp_path), "--out", str(tmp_path / "art")])
    assert result.exit_code == 0, result.output
    assert seen["progress"] == progress and result.output == f"artifact: {tmp_path / 'art'}\n"


def test_v_shows_our_info_log_and_q_hides_our_warnings(monkeypatch, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import export.tiny

    def chatty(**_: object) -> dict[str, Path]:
        logging.getLogger("export.tiny").info("an info line")
        logging.getLogger("runtime.engine").warning("a warning line")
        return {"target": tmp_path}

    monkeypatch.setattr(export.tiny, "write_tiny", chatty)
    argv = ["tiny", "--family", "llama3", "--out", str(tmp_path)]
    logged = {}
    for flags in ("-v", "", "-q"):
        caplog.clear()
        result = CliRunner().invoke(main, [*flags.split(), *argv])
        assert result.exit_code == 0 and result.stdout == f"target: {tmp_path}\n"
        logged[flags] = [r.getMessage() for r in caplog.records], result.stderr
    assert logged["-v"] == (["an info line", "a warning line"],
                            "[export.tiny] an info line\n[runtime.engine] a warning line\n")
    assert logged[""] == (["a warning line"], "")     # pytest's handler takes it; a shell's stderr would show it
    assert logged["-q"] == ([], "")
    assert logging.getLogger("export").level == logging.NOTSET and not logging.getLogger("export").handlers
    assert CliRunner().invoke(main, ["-v", "-q", *argv]).exit_code == 2


def test_run_json_is_one_document_and_q_drops_the_summary(artifact: Path) -> None:
    argv = ["run", str(artifact), "--prompt-ids", "5,6,7", "--max-tokens", "5"]
    result = CliRunner().invoke(main, [*argv, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert len(document["token_ids"]) == document["metrics"]["num_generated"] == 5
    assert document["prompt_token_ids"] == [5, 6, 7] and document["finish_reason"] == "length"
    assert "5 tokens in" in document["summary"]
    plain, quiet = CliRunner().invoke(main, argv), CliRunner().invoke(main, ["-q", *argv])
    ids = " ".join(map(str, document["token_ids"]))
    assert plain.stdout.startswith(ids) and "5 tokens in" in plain.stdout
    assert quiet.stdout.strip() == ids


def test_run_takes_generation_config_defaults_and_flags_override_them(artifact: Path, tmp_path: Path) -> None:
    """As vLLM does: a sampling flag left out takes the artifact's generation_config.json value."""
    import shutil

    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    (copy / "generation_config.json").write_text(json.dumps({"temperature": 5.0, "top_k": 50}))
    argv = ["run", str(copy), "--prompt-ids", "5,6,7", "--max-tokens", "12", "--seed", "3", "--json"]

    def tokens(*flags: str) -> list[int]:
        result = CliRunner().invoke(main, [*argv, *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["token_ids"]

    llm = LLM(copy)
    sampled = llm.generate([[5, 6, 7]], SamplingParams(temperature=5.0, top_k=50, seed=3, max_tokens=12))[0]
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert sampled.token_ids != greedy.token_ids          # temperature 5 over the tiny vocabulary: not greedy
    assert tokens() == sampled.token_ids
    assert tokens("--temperature", "0") == greedy.token_ids


def test_run_kv_memory_sizes_the_pools(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.llm import LLM

    seen, real_init = [], LLM.__init__

    def spy(self, *args, **kwargs) -> None:
        seen.append(kwargs.get("kv_memory_bytes"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", spy)
    argv = ["run", str(artifact), "--prompt-ids", "5,6,7", "--max-tokens", "2", "--json"]
    assert CliRunner().invoke(main, [*argv, "--kv-memory-mib", "64"]).exit_code == 0
    assert CliRunner().invoke(main, argv).exit_code == 0
    assert seen == [64 << 20, None]                        # None: the LLM's own default budget
    zero = CliRunner().invoke(main, [*argv, "--kv-memory-mib", "0"])
    assert zero.exit_code == 2 and "--kv-memory-mib" in zero.output
