"""`unispec demo`: the bundled trained Llama 3 + DFlash pair (models/, from `make models`) end to end.

models/llama3 + models/llama3-dflash -> `dflash` and `none` artifacts (cached under the cache dir, rebuilt
when the models change) -> ONNX Runtime CPU generation of a few held-out prompts, batch 1, greedy, every
step speculative -> generated text, mean accepted length, tokens/s of both, the speed-up, and the check that
speculative output equals target-only output token for token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from export.train.pipeline import STAMP
from runtime.errors import UnispecError

NUM_PROMPTS = 4


def _recipe_hash(model_dir: Path) -> str:
    stamp = model_dir / STAMP
    if not stamp.is_file():
        raise UnispecError(f"{model_dir} is not a bundled model (no {STAMP}); run `make models` or pass --models-dir")
    return json.loads(stamp.read_text())["recipe_hash"]


def _artifact(cache: Path, target: Path, draft: Path | None, method: str, k: int, console: Console,
              progress: bool | str | None) -> Path:
    """Export once per (method, model versions); a retrained model gets a fresh artifact."""
    from unispec.exporting import export_model

    key = "-".join([_recipe_hash(target)] + ([_recipe_hash(draft)] if draft else []))
    out = cache / f"{target.name}-{method}-k{k}"
    stamp = out / "demo-source.txt"
    if not (out / "manifest.json").is_file() or not stamp.is_file() or stamp.read_text() != key:
        if progress is not False:
            console.print(f"exporting the bundled {target.name} as `{method}` (cached after the first run)",
                          highlight=False)
        export_model(target, draft, method=method, num_speculative_tokens=k, out_dir=out, block_size=16,
                     max_model_len=512, max_batch_size=16, max_tokens_per_step=256, progress=progress)
        stamp.write_text(key)
    return out


def _timed(llm: object, prompts: list[str], params: object) -> tuple[list, float]:
    """Generate each prompt alone (batch 1) after a warm-up; returns outputs and total seconds."""
    llm.generate(prompts[:1], params)
    start, outputs = time.perf_counter(), []
    for prompt in prompts:
        outputs += llm.generate([prompt], params)
    return outputs, time.perf_counter() - start


def run_demo(models: Path, cache: Path, console: Console, *, max_tokens: int = 64,
             progress: bool | str | None = None) -> bool:
    """Returns whether speculative greedy output equalled target-only output for every prompt. `progress`:
    export_model's, for the exports a first run makes (a bar on a terminal, lines in a log)."""
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    target, draft = models / "llama3", models / "llama3-dflash"
    _recipe_hash(target), _recipe_hash(draft)          # fail early, in one line, when models/ is missing
    k = json.loads((draft / "config.json").read_text())["block_size"] - 1
    prompts = [json.loads(line)["prompt"] for line in (models / "prompts.jsonl").read_text().splitlines()][:NUM_PROMPTS]
    cache.mkdir(parents=True, exist_ok=True)
    spec_dir = _artifact(cache, target, draft, "dflash", k, console, progress)
    base_dir = _artifact(cache, target, None, "none", 0, console, progress)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # every step speculative, so that the lossless check covers every token (the default, "auto", may run
    # some steps target-only, and needs more than four prompts to settle)
    spec, spec_s = _timed(LLM(spec_dir, speculation="always"), prompts, params)
    base, base_s = _timed(LLM(base_dir), prompts, params)
    lossless = all(s.token_ids == b.token_ids for s, b in zip(spec, base))
    console.rule(f"bundled Llama 3 + DFlash (K = {k}), ONNX Runtime CPU, batch 1, greedy, "
                 "every step speculative")
    for i, (prompt, s, b) in enumerate(zip(prompts, spec, base), 1):
        same = "equals" if s.token_ids == b.token_ids else "DIFFERS FROM"
        console.print(f"[bold]prompt {i}[/bold]: accepted length {s.metrics.mean_accepted_length:.2f}, "
                      f"output {same} target-only")
        console.print(Text(prompt, style="dim"), Text(s.text, style="cyan"), sep="", end="\n\n")
    tokens = sum(len(s.token_ids) for s in spec)
    accepted = sum(s.metrics.mean_accepted_length for s in spec) / len(spec)
    console.print(f"dflash {tokens / spec_s:.0f} tokens/s, target-only {tokens / base_s:.0f} tokens/s: "
                  f"speed-up {base_s / spec_s:.2f}x, mean accepted length {accepted:.2f}; "
                  f"greedy output {'equals' if lossless else 'DIFFERS FROM'} target-only output")
    return lossless
