"""Manifests written in code, shaped as `unispec export` writes them (dim names and expressions included)."""

from __future__ import annotations

from pathlib import Path

from runtime import manifest as io
from runtime.manifest import Manifest, PoolSpec, TensorSpec


def make_manifest(*, k: int = 3, block_size: int = 4, max_model_len: int = 128, max_batch_size: int = 8,
                  max_tokens_per_step: int = 64, vocab_size: int = 320, bitmask: bool = False,
                  pools: dict[str, tuple[int, int]] | None = None) -> Manifest:
    """A unified-step manifest; `pools` maps pool name -> (layers, width), default target + draft."""
    pools = pools or {io.KV_POOL: (3, 64), io.DRAFT_KV_POOL: (1, 64)}
    batch_k = ["batch", k] if k else ["batch", 0]
    inputs = [TensorSpec(name=io.TOKENS, dtype="int64", shape=("num_tokens",)),
              TensorSpec(name=io.ROW_OFFSETS, dtype="int64", shape=("batch + 1",)),
              TensorSpec(name=io.POSITIONS, dtype="int64", shape=("num_tokens",)),
              TensorSpec(name=io.CACHE_LENGTHS, dtype="int64", shape=("batch",)),
              TensorSpec(name=io.BLOCK_TABLE, dtype="int64", shape=("batch", "max_blocks")),
              TensorSpec(name=io.DRAFT_TOKENS, dtype="int64", shape=tuple(batch_k))]
    inputs += [TensorSpec(name=name, dtype="float32", shape=("num_blocks", layers, block_size, width))
               for name, (layers, width) in pools.items()]
    inputs += [TensorSpec(name=io.CHUNK_NEXT_TOKENS, dtype="int64", shape=("batch",)),
               TensorSpec(name=io.TEMPERATURE, dtype="float32", shape=("batch",)),
               TensorSpec(name=io.TOP_K, dtype="int64", shape=("batch",)),
               TensorSpec(name=io.TOP_P, dtype="float32", shape=("batch",)),
               TensorSpec(name=io.MIN_P, dtype="float32", shape=("batch",)),
               TensorSpec(name=io.NOISE, dtype="float32", shape=("batch", k + 1, 3)),
               TensorSpec(name=io.IN_THINKING_PHASE, dtype="bool", shape=("batch",))]
    if k:
        inputs.append(TensorSpec(name=io.DRAFT_PROBS, dtype="float32", shape=("batch", k, vocab_size)))
    if bitmask:
        inputs.append(TensorSpec(name=io.TOKEN_BITMASK, dtype="int32", shape=("batch", k + 1, -(-vocab_size // 32))))
    merged = f"{k}*batch + num_tokens" if k else "num_tokens"
    outputs = [TensorSpec(name=io.NUM_ACCEPTED, dtype="int64", shape=("batch",)),
               TensorSpec(name=io.NEXT_TOKENS, dtype="int64", shape=("batch",)),
               TensorSpec(name=io.NEXT_DRAFT_TOKENS, dtype="int64", shape=tuple(batch_k))]
    if k:
        outputs.append(TensorSpec(name=io.NEXT_DRAFT_PROBS, dtype="float32", shape=("batch", k, vocab_size)))
    outputs += [TensorSpec(name=io.DELTA_OF_POOL[name], dtype="float32", shape=(merged, layers, width))
                for name, (layers, width) in pools.items()]
    return Manifest(
        method="eagle3" if k else "none", num_speculative_tokens=k, target_arch="llama3",
        draft_arch="eagle3" if k else None, vocab_size=vocab_size, dtype="float32", block_size=block_size,
        max_model_len=max_model_len, max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step,
        noise_channels=3, structured_output=bitmask,
        pools=tuple(PoolSpec(name=n, delta=io.DELTA_OF_POOL[n], num_layers=layers, width=width, dtype="float32")
                    for n, (layers, width) in pools.items()),
        inputs=tuple(inputs), outputs=tuple(outputs), ops=("PagedAttention", "SpecAccept"))


def write_fake_artifact(directory: Path, manifest: Manifest | None = None) -> Path:
    """An artifact directory whose graph files are placeholders: enough for everything before TensorRT."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = manifest or make_manifest()
    manifest.write(directory)
    (directory / manifest.model_file).write_bytes(b"not really onnx")
    (directory / manifest.weights_file).write_bytes(b"\0" * 16)
    return directory
