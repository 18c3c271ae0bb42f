"""What benchmarks/realistic_shapes.py measures on: the Llama shapes, the weight precisions, and per
(shape, precision) the files it builds once under --cache-dir/<shape>, plus the machine's read bandwidth.

    <shape>/checkpoint                     random-weight Llama (torch seed 0), models/llama3's tokenizer
    <shape>/unispec-none[-int4-b32]        `unispec export --method none [--quantize int4 --quant-block 32]`
    <shape>/ort-genai/<hash>-<precision>   onnxruntime-genai's builder at the artifact's precision
                                           (unispec/bench_peers.py genai_precision: the same bits, block,
                                           symmetry, float lm_head and MatMulNBits accuracy level)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime import manifest as io
from runtime.manifest import Manifest
from unispec.bench_common import PeerUnavailable
from unispec.bench_peers import build_genai_model, genai_precision

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "llama3"
FLOAT32 = 4
MAX_MODEL_LEN = 2048
BANDWIDTH_BYTES, BANDWIDTH_TRIES = 2**30, 5


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """The decoder linears' weights: float32, or `unispec export --quantize int4|int8` (symmetric RTN blocks
    of `block_size` along K, one float32 scale each). Norms, the embedding and the lm_head stay float32."""

    name: str                       # fp32 | int4 | int8
    block_size: int = 32

    @property
    def bits(self) -> int:
        return 32 if self.name == "fp32" else int(self.name.removeprefix("int"))

    @property
    def label(self) -> str:
        return "fp32" if self.name == "fp32" else f"{self.name} b{self.block_size}"

    def export_args(self) -> list[str]:
        return [] if self.name == "fp32" else ["--quantize", self.name, "--quant-block", str(self.block_size)]

    def linear_bytes(self, params: int) -> float:
        """Bytes of `params` linear weights: codes, plus a float32 scale per block when quantized."""
        if self.name == "fp32":
            return FLOAT32 * params
        return params * self.bits / 8 + FLOAT32 * params / self.block_size


PRECISIONS = ("fp32", "int4", "int8")


@dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self) -> dict[str, Any]:
        """LlamaConfig kwargs; special ids as models/llama3's, whose tokenizer the checkpoints share."""
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
                    vocab_size=self.vocab, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False,
                    bos_token_id=0, eos_token_id=0, pad_token_id=1, dtype="float32")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * FLOAT32

    @property
    def linear_params(self) -> int:
        """The decoder layers' linears (q o, k v, gate up down): what --quantize quantizes."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return self.layers * (h * (2 * h + 2 * kv) + 3 * h * self.intermediate)

    @property
    def float_params_read(self) -> int:
        """Float32 weights a step reads besides the linears: 2 norms a layer, the final norm, the lm_head and
        one embedding row (the table is looked up, not scanned)."""
        return self.layers * 2 * self.hidden + self.hidden + self.vocab * self.hidden + self.hidden

    def step_weight_bytes(self, precision: Precision) -> float:
        return precision.linear_bytes(self.linear_params) + FLOAT32 * self.float_params_read

    @property
    def num_params(self) -> int:
        return self.linear_params + self.float_params_read - self.hidden + self.vocab * self.hidden


SHAPES = {s.name: s for s in (
    Shape(name="h512", hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408),
    Shape(name="h1024", hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816),
    Shape(name="1b", hidden=2048, layers=22, heads=32, kv_heads=8, intermediate=5632),
)}


@dataclass(frozen=True)
class Prepared:
    checkpoint: Path
    artifact: Path
    genai: Path


def prepare(shape: Shape, cache: Path, precision: Precision = Precision(name="fp32")) -> Prepared:
    """The shape's checkpoint, unispec's `none` artifact at `precision` and the peer built to match it."""
    home = cache / shape.name
    checkpoint = write_checkpoint(shape, home)
    suffix = "" if precision.name == "fp32" else f"-{precision.name}-b{precision.block_size}"
    artifact = export_none(checkpoint, home / f"unispec-none{suffix}", precision)
    try:
        peer = genai_precision(Manifest.load(artifact).quantization)
        say(f"{shape.name}: onnxruntime-genai model (its builder, {peer.describe()}, cpu, once)")
        genai = build_genai_model(checkpoint, home / "ort-genai", peer)
    except PeerUnavailable as exc:
        raise SystemExit(f"{shape.name} {precision.label}: onnxruntime-genai, the reference of every ratio, "
                         f"cannot run: {exc}") from None
    return Prepared(checkpoint, artifact, genai)


def write_checkpoint(shape: Shape, home: Path) -> Path:
    """The shape's random-weight checkpoint with models/llama3's tokenizer, written once."""
    checkpoint = home / "checkpoint"
    config = checkpoint / "config.json"
    wanted = shape.hf_config()
    if config.is_file() and all(json.loads(config.read_text()).get(k) == v for k, v in wanted.items() if k != "dtype"):
        return checkpoint
    shutil.rmtree(home, ignore_errors=True)      # the artifacts there came from another checkpoint
    say(f"{shape.name}: writing a random-weight checkpoint ({shape.num_params / 1e6:.0f}M params)")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    tmp = home / ".checkpoint.tmp"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**wanted)).save_pretrained(tmp)
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp)
    tokenizer_config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = MAX_MODEL_LEN
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    os.replace(tmp, checkpoint)
    return checkpoint


def export_none(checkpoint: Path, out: Path, precision: Precision) -> Path:
    """unispec's target-only artifact, exported once (in a subprocess: exporting takes memory we want back)."""
    if (out / io.MANIFEST_NAME).is_file():
        return out
    say(f"exporting {out}")
    command = [sys.executable, "-m", "unispec.cli", "export", "--target", str(checkpoint), "--method", "none",
               "--out", str(out), "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", "1",
               *precision.export_args()]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
        raise SystemExit(f"unispec export of {checkpoint} ({precision.label}) failed: {lines[-1].strip()}")
    return out


def read_bandwidth() -> dict[str, Any]:
    """Single-thread read bandwidth: the best of two streaming reductions over an array far past any cache
    (torch held to one thread by the caller). Not numpy's sum: its pairwise summation is compute-bound well
    below what memory delivers (23 vs 37 GB/s on the 2-core EPYC this was written on)."""
    import torch

    data = np.ones(BANDWIDTH_BYTES // FLOAT32, dtype=np.float32)     # ones, not empty: pages touched beforehand
    kernels = {"numpy max": data.max, "torch sum": torch.from_numpy(data).sum}
    rates = {}
    for name, kernel in kernels.items():
        best = float("inf")
        for _ in range(BANDWIDTH_TRIES):
            started = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - started)
        rates[name] = BANDWIDTH_BYTES / best
    return {"bytes_per_s": max(rates.values()), "array_bytes": BANDWIDTH_BYTES, "kernel_bytes_per_s": rates}
