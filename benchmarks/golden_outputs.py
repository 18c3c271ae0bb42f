"""Token outputs of every method on ONNX Runtime, to check that a refactor or a graph rewrite changed nothing.

    python benchmarks/golden_outputs.py --out before.json [--work DIR]     # on the old tree
    python benchmarks/golden_outputs.py --out after.json --compare before.json   # on the new tree

Every method is exported (cached in --work/artifacts/<tag>/<name>) from the bundled models (models/), or, for the two
methods without a bundled draft (nextn, eagle3-mha), from tiny checkpoints written once into --work/ckpt (plain HF
directories, so a later tree reads the very same weights). Each artifact generates a batch of prompts greedily and a
batch sampled with per-request seeds (temperature 0.7 with top-k, top-p and min-p), on ONNX Runtime with 1 thread.
`--compare` exits 1 and names the first difference when any token differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"

# name -> (target dir, draft dir or None, method, K); "tiny:" dirs live under --work/ckpt
PAIRS = {
    "llama3-none": ("llama3", None, "none", 0),
    "llama3-dflash": ("llama3", "llama3-dflash", "dflash", 7),
    "llama3-eagle3": ("llama3", "llama3-eagle3", "eagle3", 3),
    "deepseek-v3-none": ("deepseek-v3", None, "none", 0),
    "deepseek-v3-mtp": ("deepseek-v3", None, "mtp", 3),
    "deepseek-v3-eagle3": ("deepseek-v3", "deepseek-v3-eagle3-mla", "eagle3", 3),
    "gemma4-none": ("gemma4", None, "none", 0),
    "gemma4-mtp": ("gemma4", "gemma4-assistant", "gemma4-mtp", 3),
    "deepseek-v3-nextn": ("tiny:nextn/target", "tiny:nextn/draft", "nextn", 3),
    "deepseek-v3-eagle3-mha": ("tiny:eagle3-mha/target", "tiny:eagle3-mha/draft", "eagle3-mha", 3),
}
NUM_PROMPTS, GREEDY_TOKENS, SAMPLED_TOKENS = 4, 32, 24


def write_tiny_checkpoints(ckpt: Path) -> None:
    """Tiny DeepSeek-V3 + NextN and + Llama-style Eagle3 checkpoints, written once (by whatever tree runs first)."""
    from export.tiny import write_tiny

    for method in ("nextn", "eagle3-mha"):
        if not (ckpt / method / "draft" / "config.json").is_file():
            write_tiny(family="deepseek-v3", method=method, out_dir=ckpt / method, seed=0)


def resolve(name: str | None, ckpt: Path) -> Path | None:
    if name is None:
        return None
    return ckpt / name.removeprefix("tiny:") if name.startswith("tiny:") else MODELS / name


def export_once(name: str, work: Path, tag: str) -> Path:
    from unispec.exporting import export_model

    target, draft, method, k = PAIRS[name]
    out = work / "artifacts" / tag / name
    if not (out / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        export_model(resolve(target, work / "ckpt"), resolve(draft, work / "ckpt"), method=method,
                     num_speculative_tokens=k, out_dir=out, max_model_len=256, max_batch_size=8,
                     max_tokens_per_step=128, progress=False)
    return out


def prompts_for(llm: object) -> list[object]:
    if llm.tokenizer is not None:
        lines = (MODELS / "prompts.jsonl").read_text().splitlines()
        return [json.loads(line)["prompt"] for line in lines[:NUM_PROMPTS]]
    vocab = llm.manifest.vocab_size
    return [[(7 * i + 3 * j + 1) % vocab for j in range(5 + 3 * i)] for i in range(NUM_PROMPTS)]


def generate(artifact: Path) -> dict[str, list[list[int]]]:
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    # every step speculative: under "auto" a seeded request's sampled tokens depend on which graph the policy
    # chose for each step (both are exact samples), so a policy change would read as a difference
    llm = LLM(artifact, num_threads=1, speculation="always")
    prompts = prompts_for(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.02, seed=100 + i,
                              max_tokens=SAMPLED_TOKENS, ignore_eos=True) for i in range(len(prompts))]
    return {"greedy": [o.token_ids for o in llm.generate(prompts, greedy)],
            "sampled": [o.token_ids for o in llm.generate(prompts, sampled)]}


def first_difference(old: dict, new: dict) -> str | None:
    for name in old:
        if name not in new:
            return f"{name}: missing in the new run"
        for mode in old[name]:
            for i, (a, b) in enumerate(zip(old[name][mode], new[name][mode])):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    return f"{name} {mode} request {i}: first differs at token {at} ({a[at:at + 4]} vs {b[at:at + 4]})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/unispec-golden"))
    parser.add_argument("--tag", default="current", help="artifact cache subfolder (one per tree)")
    parser.add_argument("--compare", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    write_tiny_checkpoints(args.work / "ckpt")
    results = {}
    for name in args.only or PAIRS:
        start = time.perf_counter()
        results[name] = generate(export_once(name, args.work, args.tag))
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    args.out.write_text(json.dumps(results) + "\n")
    if args.compare is not None:
        difference = first_difference(json.loads(args.compare.read_text()), results)
        print(difference or f"identical to {args.compare}: {len(results)} artifacts, greedy and sampled")
        return 1 if difference else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
