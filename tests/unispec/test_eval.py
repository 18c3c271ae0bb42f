"""`unispec eval` (runtime/evaluation.py, unispec/cli_eval.py): an artifact's target against a reference export
of the same target. Perplexities are checked against oracles outside the engine: Hugging Face transformers on
the tiny float checkpoint, and, for an int4 export (whose ONNX Runtime linears differ from any torch model),
the artifact's own graph run once per position over the whole prefix with no KV cache."""

from __future__ import annotations

import json
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import pytest
from click.testing import CliRunner

from runtime import manifest as io
from runtime.errors import ArtifactError
from runtime.evaluation import EVAL_LOGITS, check_pair, compare_quality, logits_view, text_windows
from tests.engines.manifests import make_manifest, write_fake_artifact
from unispec.cli import main

MODELS = Path(__file__).resolve().parents[2] / "models"
CASE = "llama3-eagle3"          # the tiny pair the runtime tests export too (the session cache shares it)


def _windows(vocab_size: int, window: int = 24, max_positions: int = 96) -> list[list[int]]:
    ids = np.random.default_rng(7).integers(0, vocab_size, 400).tolist()
    return text_windows(ids, window, max_positions)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _transformers_perplexity(checkpoint: Path, windows: list[list[int]]) -> float:
    """exp(mean NLL of each window's tokens after the first) under the checkpoint as transformers loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(windows)).logits[:, :-1].numpy()                    # [W, L, V]
    truth = np.array(windows)[:, 1:]                                                      # [W, L]
    logp = np.take_along_axis(_log_softmax(logits), truth[..., None], axis=-1)
    return float(np.exp(-logp.mean()))


def _cacheless_perplexity(artifact: Path, windows: list[list[int]]) -> float:
    """The artifact's target-only graph run on every prefix as one prefill from an empty cache (no engine, no
    chunking, nothing committed); also checks that the extra output is what the graph picks its token from."""
    from runtime.backend import shape_of
    from runtime.backends.ort import OrtBackend

    m = io.Manifest.load(artifact)
    nll, count = 0.0, 0
    with TemporaryDirectory() as scratch:
        view = logits_view(artifact, m, Path(scratch))
        longest = max(map(len, windows))
        backend = OrtBackend(scratch, view, num_blocks=view.blocks_per_row(longest))
        table = np.arange(view.blocks_per_row(longest), dtype=np.int64)[None]           # [1, max_blocks]
        for window in windows:
            for c in range(len(window) - 1):
                env = {"batch": 1, "num_tokens": c + 1, "max_blocks": table.shape[1]}
                feeds = {s.name: np.zeros(shape_of(s, env), dtype=s.dtype) for s in backend.input_specs()}
                feeds.update({io.TOKENS: np.array(window[:c + 1]), io.POSITIONS: np.arange(c + 1),
                              io.ROW_OFFSETS: np.array([0, c + 1]), io.BLOCK_TABLE: table,
                              io.CHUNK_NEXT_TOKENS: np.array([-1])})
                outputs = backend.run(feeds)
                logits = outputs[EVAL_LOGITS][0, -1]                                      # [V]
                assert outputs[io.NEXT_TOKENS][0] == logits.argmax()
                nll -= _log_softmax(logits)[window[c + 1]]
                count += 1
    return float(np.exp(nll / count))


def test_an_artifact_against_itself_agrees_everywhere_at_transformers_perplexity(tiny_artifact) -> None:
    art = tiny_artifact(CASE)
    m = io.Manifest.load(art.path)
    windows = _windows(m.vocab_size)
    quality = compare_quality(art.path, m, art.path, m, windows)
    assert (quality.positions, quality.windows, quality.window) == (96, 4, 24)
    assert quality.top1_agreement == 1.0 and quality.mean_kl == 0.0
    assert quality.perplexity == quality.reference_perplexity
    expected = _transformers_perplexity(Path(m.target_checkpoint), windows)
    assert quality.perplexity == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_int4_against_float_disagrees_somewhere_and_each_perplexity_matches_its_oracle(tiny_artifact,
                                                                                      tmp_path: Path) -> None:
    from tests.runtime.artifacts import BLOCK_SIZE, MAX_BATCH, MAX_MODEL_LEN, MAX_TOKENS_PER_STEP, K
    from unispec.exporting import export_model

    float_art = tiny_artifact(CASE).path
    ref = io.Manifest.load(float_art)
    int4 = export_model(ref.target_checkpoint, ref.draft_checkpoint, method="eagle3", num_speculative_tokens=K,
                        out_dir=tmp_path / "int4", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                        max_batch_size=MAX_BATCH, max_tokens_per_step=MAX_TOKENS_PER_STEP, quantize="int4",
                        quant_block=32, progress=False)
    m = io.Manifest.load(int4)
    windows = _windows(m.vocab_size)
    quality = compare_quality(int4, m, float_art, ref, windows)
    assert 0.5 < quality.top1_agreement < 1.0 and quality.mean_kl > 0.0
    assert quality.perplexity != quality.reference_perplexity
    assert quality.reference_perplexity == pytest.approx(
        _transformers_perplexity(Path(ref.target_checkpoint), windows), rel=1e-4)
    assert quality.perplexity == pytest.approx(_cacheless_perplexity(int4, windows), rel=1e-5)


def _one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize(("changed", "named"), [
    ({"vocab_size": 256}, "vocab_size: 320 vs 256"),
    ({"pools": {io.KV_POOL: (4, 64), io.DRAFT_KV_POOL: (1, 64)}}, "target KV pools: [('kv_pool', 3, 64)] vs "
                                                                   "[('kv_pool', 4, 64)]"),
])
def test_artifacts_of_different_targets_are_refused_in_one_line(changed: dict, named: str, tmp_path: Path) -> None:
    mine = write_fake_artifact(tmp_path / "mine", make_manifest())
    theirs = write_fake_artifact(tmp_path / "theirs", make_manifest(**changed))
    line = _one_line(CliRunner().invoke(main, ["eval", str(mine), "--reference", str(theirs)]))
    assert line == (f"Error: {mine} and --reference {theirs} hold different targets ({named}); pass two exports "
                    "of the same target checkpoint")


def test_another_tokenizer_is_refused_though_the_rest_matches(tmp_path: Path) -> None:
    mine = write_fake_artifact(tmp_path / "mine", make_manifest(k=0))
    theirs = write_fake_artifact(tmp_path / "theirs", make_manifest())     # a draft beside the same target: fine
    check_pair(mine, io.Manifest.load(mine), theirs, io.Manifest.load(theirs))
    (mine / "tokenizer.json").write_text('{"model": "one"}')
    with pytest.raises(ArtifactError, match=r"different targets \(tokenizer.json: 16 bytes vs none\)"):
        check_pair(mine, io.Manifest.load(mine), theirs, io.Manifest.load(theirs))


def test_the_command_reports_agreement_perplexity_and_acceptance_as_json(tiny_artifact, tmp_path: Path) -> None:
    art = tiny_artifact(CASE + "-json").path                   # the tiny pair with a tokenizer
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; hello world, this is a tiny tokenizer. " * 20)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    result = CliRunner().invoke(main, ["eval", str(art), "--reference", str(art), "--text", str(text),
                                       "--window", "40", "--max-tokens", "80", "--prompts", str(prompts),
                                       "--new-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    quality, acceptance = report["quality"], report["acceptance"]
    assert (quality["positions"], quality["windows"], quality["window"]) == (80, 2, 40)
    assert quality["top1_agreement"] == 1.0 and quality["perplexity"] == quality["reference_perplexity"]
    assert (acceptance["prompts"], acceptance["max_tokens"], acceptance["ratio"]) == (2, 6, 1.0)
    assert acceptance["mean_accepted_length"] >= 1.0
    assert report["weights"] == {"artifact": "float32", "reference": "float32"} and report["notes"] == []


def test_by_default_the_bundled_models_held_out_windows_are_scored(bundled_artifact: Path) -> None:
    """The default text and windows are export/train's own: its held-out stream (each held-out stdlib file's
    tokens, then EOS) cut by its fixed_windows. On the stdlib the bundled models were trained on, the reference's
    perplexity is then exp(the model card's held-out loss), 2.6102 nats on Python 3.11.7."""
    import torch
    from tokenizers import Tokenizer

    from export.train.common import fixed_windows
    from export.train.corpus import HELD_OUT_CHARS, stdlib_corpus

    result = CliRunner().invoke(main, ["eval", str(bundled_artifact), "--reference", str(bundled_artifact),
                                       "--new-tokens", "0", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    tokenizer = Tokenizer.from_file(str(MODELS / "llama3" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = [t for e in tokenizer.encode_batch(stdlib_corpus().texts("held_out", HELD_OUT_CHARS)) for t in [*e.ids, eos]]
    windows = fixed_windows(torch.tensor(ids), 129, 32).tolist()
    assert (report["quality"]["positions"], report["quality"]["windows"]) == (4096, 32)
    assert report["quality"]["reference_perplexity"] == pytest.approx(
        _transformers_perplexity(MODELS / "llama3", windows), rel=1e-4)
    assert report["notes"] == ["acceptance not measured (--new-tokens 0)"]
