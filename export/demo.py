"""`unispec demo` until the bundled trained models land (issue #9): the whole pipeline on tiny random weights.

tiny Llama 3 + DFlash checkpoints -> `dflash` and `none` artifacts (cached) -> ONNX Runtime generation ->
greedy speculative output compared with target-only output. Random weights accept almost no drafts, so
the acceptance and speed printed here say nothing about speculative decoding's gains; the trained models
and `unispec bench` of issue #9 will.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

PROMPTS = ([5, 17, 42, 99, 7, 3, 61], [200, 13, 13, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])


def _artifact(cache: Path, name: str, tiny: dict[str, Path], method: str, k: int) -> Path:
    from export.artifact import export_model

    out = cache / name
    if not (out / "manifest.json").is_file():
        export_model(tiny["target"], tiny.get("draft") if method != "none" else None, method=method,
                     num_speculative_tokens=k, out_dir=out, block_size=8, max_model_len=256, max_batch_size=4,
                     max_tokens_per_step=64, progress=False)
    return out


def run_demo(cache: Path, console: Console, *, max_tokens: int = 32) -> bool:
    """Returns whether speculative greedy output equalled target-only output for every prompt."""
    from export.tiny import write_tiny
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    cache.mkdir(parents=True, exist_ok=True)
    with console.status("writing tiny checkpoints and exporting (cached after the first run)..."):
        tiny = write_tiny(family="llama3", draft="dflash", out_dir=cache / "tiny", seed=0)
        spec_dir = _artifact(cache, "llama3-dflash", tiny, "dflash", 3)
        base_dir = _artifact(cache, "llama3-none", tiny, "none", 0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)  # greedy: comparable
    spec = LLM(spec_dir).generate([list(p) for p in PROMPTS], params)
    base = LLM(base_dir).generate([list(p) for p in PROMPTS], params)
    table = Table(title="tiny random Llama 3 + DFlash (K = 3) on ONNX Runtime CPU")
    for column in ("prompt", "first generated ids", "mean accepted length", "tokens/s", "== target-only"):
        table.add_column(column)
    lossless = True
    for prompt, s, b in zip(PROMPTS, spec, base):
        same = s.token_ids == b.token_ids
        lossless &= same
        table.add_row(str(list(prompt)), str(s.token_ids[:8]) + " ...", f"{s.metrics.mean_accepted_length:.2f}",
                      f"{s.metrics.tokens_per_s:.0f}", "yes" if same else "NO")
    console.print(table)
    console.print("Random weights accept almost no drafts: these figures show the pipeline works, not the "
                  "speed-up. Trained bundled models and `unispec bench` arrive with issue #9.")
    return lossless
