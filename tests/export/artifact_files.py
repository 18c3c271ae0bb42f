"""What tests/export/test_artifact.py's checkpoints ship beside their weights, and a size its graphs are held to."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

THINK_START, THINK_END = 300, 301


def add_tokenizer_files(target: Path) -> None:
    """What a real checkpoint ships next to its weights (the tiny writer writes none)."""
    added = [{"id": THINK_START, "content": "<think>", "special": True},
             {"id": THINK_END, "content": "</think>", "special": True}]
    (target / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": added}))
    (target / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))


def largest_inline_tensor(graph: onnx.GraphProto) -> int:
    """The largest tensor a graph holds inline (initializers and constants, subgraphs included), in bytes."""
    sizes = [len(t.raw_data) for t in graph.initializer if not t.external_data]
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                sizes.append(largest_inline_tensor(attribute.g))
            elif attribute.type == onnx.AttributeProto.TENSOR:
                sizes.append(len(attribute.t.raw_data))
    return max(sizes, default=0)
