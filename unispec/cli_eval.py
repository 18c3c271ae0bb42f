"""`unispec eval`: what an export costs in quality, against a reference export of the same target (issue 35).

    unispec eval artifacts/int4 --reference artifacts/float

Over held-out text (default: the Python standard library files `make models` held out of training, the text
of the model cards' held-out loss), per position: top-1 agreement of the artifact's target with the
reference's, the perplexity of each and KL(reference || artifact); then greedy speculative decoding of the
held-out prompts (models/prompts.jsonl, as `unispec bench`) by each pair: mean accepted length and ratio.
The measuring lives in runtime/evaluation.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from runtime.errors import InvalidRequestError, UnispecError
from unispec.cli_common import JSON_OPTION, echo_json, progress_reporter, verbosity
from unispec.cli_errors import read_text

__all__ = ["eval_command"]

ARTIFACT_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    artifact_dir: Path
    reference_dir: Path
    text: Path | None
    max_tokens: int
    window: int
    prompts: Path | None
    new_tokens: int
    as_json: bool


@click.command("eval")
@click.argument("artifact_dir", type=ARTIFACT_DIR)
@click.option("--reference", "reference_dir", type=ARTIFACT_DIR, required=True,
              help="An export of the same target to measure against (float32, say, for a --quantize one).")
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="UTF-8 text to score.  [default: the stdlib files held out of the bundled models' training]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Positions of the text to score at most (the defaults: the 32 windows of the model cards' "
                   "held-out loss).")
@click.option("--window", type=click.IntRange(min=1), default=128, show_default=True,
              help="Scored positions per window (at most both artifacts' max_model_len - 1).")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Acceptance prompts, .jsonl or one per line.  [default: as `unispec bench`]")
@click.option("--new-tokens", type=click.IntRange(min=0), default=64, show_default=True,
              help="Greedy tokens per prompt for the acceptance lengths (0: skip them).")
@JSON_OPTION
def eval_command(**options: Any) -> None:
    """Top-1 agreement, perplexity and KL of an artifact's target against a reference export's on held-out
    text, and the mean accepted length of both pairs."""
    from rich.console import Console

    from runtime import evaluation
    from runtime.artifact_check import check_artifact
    from runtime.manifest import Manifest

    config = EvalConfig(**options)
    m, ref = Manifest.load(config.artifact_dir), Manifest.load(config.reference_dir)
    evaluation.check_pair(config.artifact_dir, m, config.reference_dir, ref)
    check_artifact(config.artifact_dir, m)
    check_artifact(config.reference_dir, ref)
    ids, source = _text_ids(config, m)
    window = min(config.window, m.max_model_len - 1, ref.max_model_len - 1)
    windows = evaluation.text_windows(ids, window, config.max_tokens)
    with progress_reporter("eval", verbosity()) as progress:
        report = progress and (lambda what: progress(what, True))
        quality = evaluation.compare_quality(config.artifact_dir, m, config.reference_dir, ref, windows,
                                             progress=report)
        acceptance, note = None, _no_acceptance(config, m, ref)
        if note is None:
            acceptance = evaluation.compare_acceptance(config.artifact_dir, config.reference_dir, _prompts(config, m),
                                                       max_tokens=config.new_tokens, progress=report)
    document = {"artifact": config.artifact_dir, "reference": config.reference_dir,
                "weights": {"artifact": _weights(m), "reference": _weights(ref)}, "text": source,
                "quality": asdict(quality),
                "acceptance": None if acceptance is None else {**asdict(acceptance), "ratio": acceptance.ratio},
                "notes": [] if note is None else [note]}
    if config.as_json:
        echo_json(document)
        return
    console = Console(highlight=False)
    console.print(_table(document, quality, acceptance))
    console.print(_headline(quality, acceptance, note))


def _text_ids(config: EvalConfig, m: Any) -> tuple[list[int], str]:
    """The text's token ids (the artifact's tokenizer, no special tokens added) and what it is."""
    from runtime.tokenizer import TOKENIZER_FILE, TextTokenizer

    tokenizer = TextTokenizer.from_dir(config.artifact_dir)
    if tokenizer is None:
        raise InvalidRequestError(f"{config.artifact_dir} has no {TOKENIZER_FILE}, so no text can be scored; "
                                  "export from a checkpoint that ships its tokenizer")
    if config.text is not None:
        return tokenizer.encode(read_text(config.text, "--text"), add_special_tokens=False), str(config.text)
    from export.train.corpus import HELD_OUT_CHARS, stdlib_corpus

    try:
        corpus = stdlib_corpus()
    except FileNotFoundError as exc:
        raise UnispecError(f"{exc}; or pass --text FILE") from None
    separator = list(m.tokenizer.eos_token_ids[:1])        # each file then EOS, as the training streams
    ids = [t for body in corpus.texts("held_out", HELD_OUT_CHARS)
           for t in (*tokenizer.encode(body, add_special_tokens=False), *separator)]
    return ids, f"held-out stdlib files of {corpus.root} ({len(corpus.held_out_files)} files, crc32(path) % 10 == 0)"


def _no_acceptance(config: EvalConfig, m: Any, ref: Any) -> str | None:
    """Why the acceptance lengths are not measured, or None when they are."""
    if config.new_tokens == 0:
        return "acceptance not measured (--new-tokens 0)"
    if m.method == "none" or ref.method == "none":
        return "acceptance not measured: a `none` artifact has no draft"
    if (m.method, m.draft_arch) != (ref.method, ref.draft_arch):
        return f"acceptance not measured: the drafts differ ({m.method} vs {ref.method})"
    return None


def _prompts(config: EvalConfig, m: Any) -> list[str]:
    """The acceptance prompts, found as `unispec bench` finds its own."""
    from unispec.bench import find_prompts, load_prompts

    checkpoint = Path(m.target_checkpoint) if m.target_checkpoint else None
    try:
        return load_prompts(find_prompts(config.prompts, checkpoint))
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{exc}; or --new-tokens 0 to skip the acceptance lengths") from None


def _weights(m: Any) -> str:
    """The target's weights in a few words: its dtype, and its quantization when it has one."""
    q = {k: v for k, v in (m.quantization or {}).items() if k != "draft"}
    return m.dtype if q.get("method", "none") == "none" else f"{m.dtype}, " + " ".join(f"{k} {v}" for k, v in q.items())


def _table(document: dict[str, Any], quality: Any, acceptance: Any) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table("", "artifact", "reference",
                  title=escape(f"unispec eval {document['artifact']} --reference {document['reference']}"),
                  title_justify="left", caption_justify="left",
                  caption=escape(f"{quality.positions} positions: {quality.windows} windows of {quality.window} "
                                 f"tokens from {document['text']}"))
    table.add_row("weights", escape(document["weights"]["artifact"]), escape(document["weights"]["reference"]))
    table.add_row("top-1 agreement with the reference", f"{quality.top1_agreement:.2%}", "100%")
    table.add_row("perplexity", f"{quality.perplexity:.4f}", f"{quality.reference_perplexity:.4f}")
    table.add_row("mean KL(reference ‖ artifact), nats", f"{quality.mean_kl:.5f}", "0")
    if acceptance is not None:
        table.add_row(f"mean accepted length ({acceptance.prompts} prompts × {acceptance.max_tokens} greedy tokens)",
                      f"{acceptance.mean_accepted_length:.3f}", f"{acceptance.reference_mean_accepted_length:.3f}")
    return table


def _headline(quality: Any, acceptance: Any, note: str | None) -> str:
    ratio = quality.perplexity / quality.reference_perplexity
    line = (f"the artifact agrees with the reference's next token {quality.top1_agreement:.1%} of the time; "
            f"perplexity ×{ratio:.3f}")
    return f"{line}; accepted length ×{acceptance.ratio:.3f}" if acceptance is not None else f"{line}; {note}"
