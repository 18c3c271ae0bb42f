"""Tiny artifacts for the runtime tests: tiny checkpoints -> unified step -> artifact dir.

Plain cases (CASES) carry no tokenizer and no structured output. A "-json" case (JSON_CASES) is the same
pair whose target checkpoint first gets a byte-level BPE tokenizer trained here (vocabulary <= the tiny
models' 320, with <s> / </s>, <think> / </think> and chat-role special tokens), a generation_config.json
naming its BOS / EOS and a tokenizer_config.json with a chat template (export_model copies them), and
which is exported with structured output (the `token_bitmask` input).
Returns the torch step too (same checkpoints, same weights): the reference the runtime must match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import manifest as io

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128
MAX_BATCH = 8
MAX_TOKENS_PER_STEP = 64
K = 3

# (tiny family, method) for every method; `none` once per family. Exported as the other runtime
# and engine tests expect them: no tokenizer, no structured output.
CASES: dict[str, tuple[str, str]] = {
    "llama3-none": ("llama3", "none"), "deepseek-v3-none": ("deepseek-v3", "none"), "gemma4-none": ("gemma4", "none"),
    "llama3-eagle3": ("llama3", "eagle3"), "llama3-dflash": ("llama3", "dflash"),
    "deepseek-v3-mtp": ("deepseek-v3", "mtp"), "deepseek-v3-nextn": ("deepseek-v3", "nextn"),
    "deepseek-v3-eagle3": ("deepseek-v3", "eagle3"), "deepseek-v3-eagle3-mha": ("deepseek-v3", "eagle3-mha"),
    "gemma4-gemma4-mtp": ("gemma4", "gemma4-mtp"),
}
# one case per method, for tests that cover every method once (float16 exports, engine builds)
METHOD_CASES: dict[str, str] = {
    "none": "llama3-none", "mtp": "deepseek-v3-mtp", "nextn": "deepseek-v3-nextn", "eagle3": "deepseek-v3-eagle3",
    "eagle3-mha": "deepseek-v3-eagle3-mha", "dflash": "llama3-dflash", "gemma4-mtp": "gemma4-gemma4-mtp",
}
# "<case>-json": the same pair with the test tokenizer and structured output (the `token_bitmask` input)
JSON_SUFFIX = "-json"
JSON_CASES: dict[str, tuple[str, str]] = {f"{case}{JSON_SUFFIX}": pair for case, pair in CASES.items()}

# the test tokenizer's special tokens, in id order
UNK, BOS, EOS, THINK, END_THINK, USER, ASSISTANT = range(7)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<think>", "</think>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass(frozen=True)
class TinyArtifact:
    path: Path
    step: object          # the torch UnifiedStep built from the same checkpoints
    family: str
    method: str

    def run_torch(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The torch step on feeds without `token_bitmask` (tests/reference_loop.py's): every token allowed."""
        if getattr(self.step, "structured_output", False) and io.TOKEN_BITMASK not in feeds:
            batch, k = feeds[io.DRAFT_TOKENS].shape
            vocab = io.Manifest.load(self.path).vocab_size
            feeds = {**feeds, io.TOKEN_BITMASK: torch.full((batch, k + 1, -(-vocab // 32)), -1, dtype=torch.int32)}
        return self.step.run(feeds)


def _k_for(method: str, draft_dir: Path | None) -> int:
    if method == "none":
        return 0
    if method == "dflash":
        return json.loads((draft_dir / "config.json").read_text())["block_size"] - 1
    return K


def write_tokenizer(target_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE (vocabulary <= vocab_size) trained on JSON-ish and plain text, plus its configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps({"a": i * 7 % 1000, "b": i % 3 == 0, "name": f"item {i}"}, separators=(",", ":"))
              for i in range(300)]
    corpus += ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    tokenizer.save(str(target_dir / "tokenizer.json"))
    (target_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    (target_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIAL_TOKENS[BOS], "eos_token": SPECIAL_TOKENS[EOS], "chat_template": CHAT_TEMPLATE}))


def make_artifact(case: str, root: Path, *, dtype: str = "float32") -> TinyArtifact:
    from export.tiny import write_tiny
    from unispec.exporting import export_model

    family, method = {**CASES, **JSON_CASES}[case]
    structured = case in JSON_CASES
    paths = write_tiny(family=family, method=method, out_dir=root / "checkpoints", seed=0)
    if structured:
        write_tokenizer(paths["target"], vocab_size=320)
    export_model(paths["target"], paths.get("draft"), method=method,
                 num_speculative_tokens=_k_for(method, paths.get("draft")), out_dir=root / "artifact",
                 dtype=dtype, structured_output=structured, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                 max_batch_size=MAX_BATCH, max_tokens_per_step=MAX_TOKENS_PER_STEP, progress=False)
    return open_artifact(case, root)


def open_artifact(case: str, root: Path) -> TinyArtifact:
    """The artifact make_artifact wrote under `root`, with its torch step built again from the checkpoints."""
    from export.methods import build_step

    family, method = {**CASES, **JSON_CASES}[case]
    target, draft = root / "checkpoints" / "target", root / "checkpoints" / "draft"
    draft = draft if draft.is_dir() else None
    step = build_step(method, target, draft, k=_k_for(method, draft)).eval()
    step.structured_output = case in JSON_CASES
    return TinyArtifact(root / "artifact", step, family, method)
