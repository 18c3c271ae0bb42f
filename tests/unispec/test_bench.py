"""`unispec bench`: a tiny Llama 3 + DFlash artifact against its `none` artifact, transformers and
onnxruntime-genai in one run (JSON fields, positive ratios, graph + host time within the wall time, a real
PNG); peers that cannot run are rows saying why; bad options and missing prompts fail in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.errors import InvalidRequestError
from runtime.manifest import Manifest
from unispec import bench
from unispec.bench import (
    BenchConfig,
    Pass,
    PeerUnavailable,
    Row,
    batches_of,
    load_prompts,
    measure,
    measure_interleaved,
)
from unispec.bench_peers import (
    GenaiPrecision,
    Unavailable,
    count_generated,
    genai_build_command,
    genai_model_dir,
    genai_precision,
    peer_runners,
)
from unispec.cli import main

PROMPTS = ["the quick brown fox", "hello world, this is", '{"a": 7, "name": "item 3"}']


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama 3 + DFlash checkpoints with the test tokenizer, prompts.jsonl beside them, both artifacts."""
    from export.tiny import write_tiny
    from tests.runtime.artifacts import write_tokenizer
    from unispec.exporting import export_model

    root = tmp_path_factory.mktemp("bench")
    paths = write_tiny(family="llama3", method="dflash", out_dir=root / "checkpoints", seed=0)
    write_tokenizer(paths["target"], vocab_size=320)
    (root / "checkpoints" / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    geometry = dict(block_size=4, max_model_len=128, max_batch_size=4, max_tokens_per_step=64, progress=False)
    export_model(paths["target"], paths["draft"], method="dflash", num_speculative_tokens=3,
                 out_dir=root / "dflash", **geometry)
    export_model(paths["target"], method="none", num_speculative_tokens=0, out_dir=root / "none", **geometry)
    return {**paths, "dflash": root / "dflash", "none": root / "none", "root": root}


def test_one_run_reports_every_engine_with_json_and_plot(tiny: dict[str, Path], tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(main, [
        "bench", str(tiny["dflash"]), "--baseline", str(tiny["none"]), "--batch-sizes", "1,2",
        "--temperature", "0,0.7", "--repeats", "1", "--max-tokens", "8", "--threads", "1",
        "--cache-dir", str(tmp_path / "cache"), "--json", str(out_json), "--plot", str(out_png)])
    assert result.exit_code == 0, result.output
    for text in ("unispec dflash (ort)", "unispec none (ort)", "transformers generate", "not run",
                 "1 intra-op threads", "target-only %", "expected"):
        assert text in result.output
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000

    report = json.loads(out_json.read_text())
    assert report["config"]["batch_sizes"] == [1, 2] and report["config"]["threads"] == 1
    assert {"platform", "cpu_count", "threads", "versions"} <= set(report["machine"])
    assert f"peers load {tiny['target']}" in report["notes"]            # the manifest's target_checkpoint
    rows = {(r["engine"], r["batch_size"], r["temperature"]): r for r in report["rows"]}
    assert len(rows) == len(report["rows"]) == 2 * 2 * 6          # cells x (ours, none, 3 transformers, genai)
    step_shares = []
    for size in (1, 2):
        for temperature in (0.0, 0.7):
            ours = rows[("unispec dflash (ort)", size, temperature)]
            m, (run,) = ours["median"], ours["runs"]
            assert m["tokens"] == 8 * size and m["tokens_per_s"] > 0 and ours["speedup"] == 1.0
            assert m["mean_accepted_length"] >= 1 and len(m["acceptance_per_position"]) == 3
            assert m["graph_ms_per_step"] > 0 and m["host_ms_per_step"] > 0 and 0 < m["host_share"] < 1
            assert 0 <= m["target_only_share"] <= 1                           # adaptive speculation's mode mix
            assert ours["expected_speedup"] is None or ours["expected_speedup"] > 0
            assert 0 < run["graph_s"] + run["host_s"] <= run["wall_s"]
            step_shares.append((run["graph_s"] + run["host_s"]) / run["wall_s"])
            for engine in ("unispec none (ort)", "transformers generate"):
                theirs = rows[(engine, size, temperature)]
                assert theirs["why"] is None and theirs["median"]["tokens"] == 8 * size and theirs["speedup"] > 0
            assert "head on the target's hidden states" in rows[("transformers assisted", size, temperature)]["why"]
            lookup = rows[("transformers prompt lookup", size, temperature)]
            assert (lookup["why"] is None) == (size == 1)
            genai = rows[("onnxruntime-genai (cpu)", size, temperature)]
            assert genai["why"] is not None or genai["median"]["tokens"] == 8 * size
            assert genai["why"] is not None or "onnxruntime-genai built fp32" in report["notes"]
    # steps are most of a pass (one 8-token pass per cell, ~6 ms: a scheduler hiccup on a shared machine can
    # take half of one, so the best of the four cells is held to it)
    assert max(step_shares) > 0.5, step_shares


def test_peers_that_cannot_run_are_rows_saying_why(tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    manifest = Manifest.load(tiny["dflash"])
    config = BenchConfig(artifact_dir=tiny["dflash"], threads=1, cache_dir=tmp_path)
    runners, _ = peer_runners(config, manifest, None)
    assert all(isinstance(r, Unavailable) and "pass --checkpoint" in r.why for r in runners)

    deepseek = Manifest.from_dict({**json.loads(manifest.to_json()), "target_arch": "deepseek-v3"})
    genai = peer_runners(BenchConfig(artifact_dir=tiny["dflash"], peers=("ort-genai",), cache_dir=tmp_path),
                         deepseek, tiny["target"])[0]
    assert "Llama 3 targets only; this target is deepseek-v3" in genai[0].why

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)           # as if it were not installed
    genai = peer_runners(BenchConfig(artifact_dir=tiny["dflash"], peers=("ort-genai",), cache_dir=tmp_path),
                         manifest, tiny["target"])[0]
    row = measure(genai[0], [[[1, 2, 3]]], 0.0, 4)
    assert row.why == "onnxruntime-genai is not installed (pip install 'unispec[bench]')" and not row.passes


def test_the_genai_peer_is_built_at_the_artifacts_precision(tmp_path: Path) -> None:
    from engines.ort.quant import DEFAULT_ACCURACY_LEVEL
    from export.quantize import QuantizeSettings

    def args(precision: GenaiPrecision) -> list[str]:
        command = genai_build_command(tmp_path / "ckpt", tmp_path / "out", precision)
        assert command[command.index("-e") + 1] == "cpu" and command.count("-p") == 1
        return command[command.index("-p") + 1:]

    int4 = genai_precision(QuantizeSettings(bits=4, block_size=64).manifest_entry())
    assert args(int4) == ["int4", "--extra_options", "block_size=64", f"accuracy_level={DEFAULT_ACCURACY_LEVEL}",
                          "is_symmetric=true", "nodes_to_exclude=/lm_head/MatMul"]       # the head stays float
    int8_head = genai_precision(QuantizeSettings(bits=8, block_size=32, lm_head=True).manifest_entry())
    assert args(int8_head) == ["int8", "--extra_options", "block_size=32", f"accuracy_level={DEFAULT_ACCURACY_LEVEL}",
                               "is_symmetric=true"]
    fp32 = genai_precision(None)
    assert args(fp32) == ["fp32"]
    draft_only = {"method": "none", "draft": QuantizeSettings(bits=4).manifest_entry()}
    assert genai_precision(draft_only) == fp32                          # a float target, its drafter int4
    with pytest.raises(PeerUnavailable, match="float32 and --quantize int4/int8 targets; this one is method=awq"):
        genai_precision({"method": "awq", "bits": 4, "group_size": 128, "zero_point": True})

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    int4_block32 = genai_precision(QuantizeSettings(bits=4, block_size=32).manifest_entry())
    precisions = (fp32, int4, int4_block32, int8_head)
    dirs = {genai_model_dir(checkpoint, tmp_path / "cache", p) for p in precisions}
    assert len(dirs) == len(precisions)                 # a build at one precision never answers for another
    again = genai_model_dir(checkpoint, tmp_path / "elsewhere", int4)
    assert again.name == genai_model_dir(checkpoint, tmp_path / "cache", int4).name     # content, not place


def test_a_failing_peer_is_a_row_and_medians_are_per_figure() -> None:
    class Broken:
        name = "broken"

        def run(self, prompts, temperature, max_tokens):
            raise RuntimeError("kernel exploded\nsecond line")

        def close(self) -> None:
            pass

    assert measure(Broken(), [[[1]]], 0.0, 4).why == "RuntimeError: kernel exploded"
    row = Row("x", 1, 0.0, passes=[Pass(wall_s=w, tokens=8, steps=4, graph_s=w / 2, host_s=w / 4,
                                        mean_accepted_length=a, acceptance_per_position=(a - 1, 0.0))
                                   for w, a in ((1.0, 1.5), (2.0, 1.25), (4.0, 2.0))])
    m = row.median
    assert m["tokens_per_s"] == 4.0 and m["mean_accepted_length"] == 1.5 and m["acceptance_per_position"] == [0.5, 0.0]
    assert m["host_share"] == pytest.approx(1 / 3) and m["graph_ms_per_step"] == 250.0


def test_interleaved_passes_alternate_engines_and_speedups_are_per_repeat_medians(monkeypatch) -> None:
    calls: list[tuple[str, int]] = []

    class Fake:
        def __init__(self, name: str, walls: list[float], fail_at: int | None = None) -> None:
            self.name, self.walls, self.fail_at, self.n = name, walls, fail_at, 0

        def run(self, prompts, temperature, max_tokens):
            calls.append((self.name, prompts[0][0]))
            self.n += 1
            if self.n == self.fail_at:
                raise RuntimeError("gave up")
            return Pass(wall_s=self.walls[self.n - 1], tokens=10)

        def close(self) -> None:
            pass

    # the machine slows down 10x in repeat 2 for both engines: per-repeat ratios stay 2.0, medians would not
    ours = Fake("ours", [1.0, 1.0, 10.0, 1.0])
    theirs = Fake("theirs", [2.0, 2.0, 20.0, 2.0])
    broken = Fake("broken", [1.0] * 4, fail_at=2)
    batches = [[[r]] for r in range(3)]
    flushes = 0

    def flush() -> None:
        nonlocal flushes
        flushes += 1

    monkeypatch.setattr(bench, "flush_caches", flush)
    rows = measure_interleaved([ours, theirs, broken], batches, 0.0, 4)
    assert calls == [("ours", 0), ("theirs", 0), ("broken", 0), ("ours", 0), ("theirs", 0), ("broken", 0),
                     ("ours", 1), ("theirs", 1), ("ours", 2), ("theirs", 2)]      # warm-ups, then by repeat
    assert rows[2].why == "RuntimeError: gave up" and not rows[2].passes
    assert flushes == 7                                    # before every timed pass, the failing one's too
    assert all(p.cpu_s is not None and p.cpu_s >= 0 for p in rows[0].passes)
    bench._add_speedups(rows, paired=True)
    assert rows[1].speedup == pytest.approx(2.0) and rows[0].speedup == 1.0 and rows[2].speedup is None
    rows[1].passes[1] = Pass(wall_s=200.0, tokens=10)                 # a repeat where only the peer was hit
    bench._add_speedups(rows, paired=True)
    assert rows[1].speedup == pytest.approx(2.0)                      # the median of (2, 20, 2) ignores it


def test_the_cache_flush_reads_a_buffer_larger_than_a_last_level_cache() -> None:
    bench.flush_caches()
    assert bench.flush_buffer().nbytes == bench.FLUSH_BYTES >= 128 << 20


def test_generated_tokens_are_counted_up_to_the_first_eos() -> None:
    assert count_generated([[5, 6, 7], [5, 2, 0], [2, 2, 2]], eos={2}) == 3 + 2 + 1


def test_passes_take_successive_prompts() -> None:
    assert batches_of([[1], [2], [3]], 2, 3) == [[[1], [2]], [[3], [1]], [[2], [3]]]


def test_prompt_files_and_where_they_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b c"}\n')
    (tmp_path / "p.txt").write_text("one\ntwo\n")
    assert load_prompts(tmp_path / "p.jsonl") == ["a", "b c"] and load_prompts(tmp_path / "p.txt") == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(InvalidRequestError, match=r"bad.jsonl:1: expected an object with a string \"prompt\""):
        load_prompts(tmp_path / "bad.jsonl")

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    monkeypatch.setattr(bench, "REPO_PROMPTS", tmp_path / "models" / "prompts.jsonl")
    config = BenchConfig(artifact_dir=tmp_path)
    with pytest.raises(InvalidRequestError, match="no prompts: pass --prompts FILE"):
        bench.find_prompts(config.prompts, checkpoint)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "beside"}\n')
    assert bench.find_prompts(config.prompts, checkpoint) == tmp_path / "prompts.jsonl"


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x': expected comma-separated ints >= 1, e.g. 1,4,16"),
    (["--batch-sizes", "0"], "--batch-sizes '0': expected comma-separated ints >= 1"),
    (["--temperature", "-1"], "--temperature '-1': expected comma-separated floats >= 0"),
    (["--repeats", "0"], "--repeats needs integers >= 1, got 0"),
    (["--peers", "vllm"], "--peers: unknown ['vllm']"),
])
def test_bad_options_fail_in_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["bench", str(tmp_path), *argv])
    assert result.exit_code == 1 and message in result.output, result.output
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output


def test_a_baseline_that_is_not_target_only_is_refused(tiny: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["bench", str(tiny["dflash"]), "--baseline", str(tiny["dflash"]),
                                       "--threads", "1", "--peers", "none"])
    assert result.exit_code == 1 and "pass the `none` artifact of the same llama3 target" in result.output
    assert result.output.strip().count("\n") == 0


def test_unavailable_peer_raises_its_reason() -> None:
    with pytest.raises(PeerUnavailable, match="why"):
        Unavailable("x", "why").run([[1]], 0.0, 1)
