"""A byte-level BPE tokenizer trained with the `tokenizers` library, saved as tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)      # ids 0, 1, 2


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over `texts` (deterministic for the same texts and vocab size)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


# The toy tokenizers know no chat header tokens, so chats render as plain text (what `unispec serve`'s chat
# routes and `unispec run --chat` encode).
CHAT_TEMPLATE = """{% for message in messages %}
<|{{ message['role'] }}|>
{{ message['content'] }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (what transformers and onnxruntime-genai look for)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None, "pad_token": PAD,
              "unk_token": None, "model_max_length": 1024, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
