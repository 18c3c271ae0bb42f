"""Export a unified step module to ONNX (opset 24, IR 10) with the contract's dynamic dimensions.

Dimension names: num_tokens (S), batch (B), batch + 1 (row_offsets), max_blocks, num_blocks; K, the pool
geometry and the vocabulary are static per artifact. Example inputs always have B >= 2 and S >= 2 (a
size-1 example silently freezes a dimension), a `-1` draft row, a chunked-prefill row and mixed sampling
parameters, so no branch of the graph is specialised away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

import plugins
from export.step.base import UnifiedStep
from export.step.spec_glue import NOISE_CHANNELS
from plugins.onnx_optimizer import fast_rules
from runtime import manifest as io
from runtime.pool_layout import PoolLayout

if TYPE_CHECKING:
    import onnx_ir as ir

OPSET = 24


def example_feeds(step: UnifiedStep, *, lengths: Sequence[int] = (2, 3, 4), cache_lengths: Sequence[int] = (5, 0, 9),
                  block_size: int = 4, vocab: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Valid random inputs for one step: distinct shuffled blocks per row, drafts within `vocab`."""
    g = torch.Generator().manual_seed(seed)
    batch, k = len(lengths), step.k
    max_blocks = io.blocks_per_row(max(c + n for c, n in zip(cache_lengths, lengths)), num_speculative_tokens=k,
                                   block_size=block_size)
    num_blocks = batch * max_blocks + 3
    feeds = {
        io.TOKENS: torch.randint(1, vocab, (sum(lengths),), generator=g),
        io.ROW_OFFSETS: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        io.POSITIONS: torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lengths, lengths)]),
        io.CACHE_LENGTHS: torch.tensor(list(cache_lengths)),
        io.BLOCK_TABLE: torch.randperm(num_blocks, generator=g)[: batch * max_blocks].reshape(batch, max_blocks),
        io.DRAFT_TOKENS: torch.randint(1, vocab, (batch, k), generator=g),
        io.CHUNK_NEXT_TOKENS: torch.full((batch,), -1),
        io.TEMPERATURE: torch.zeros(batch),
        io.TOP_K: torch.zeros(batch, dtype=torch.int64),
        io.TOP_P: torch.ones(batch),
        io.MIN_P: torch.zeros(batch),
        io.NOISE: torch.rand(batch, k + 1, NOISE_CHANNELS, generator=g),
        io.IN_THINKING_PHASE: torch.zeros(batch, dtype=torch.bool),
    }
    feeds[io.DRAFT_TOKENS][0] = -1                                   # a row without drafts (prefill)
    feeds[io.CHUNK_NEXT_TOKENS][0] = 3                               # ... whose prompt continues next step
    feeds[io.TEMPERATURE][-1], feeds[io.TOP_K][-1], feeds[io.TOP_P][-1] = 0.8, 5, 0.9
    feeds[io.MIN_P][-1] = 0.05
    feeds[io.IN_THINKING_PHASE][-1] = True
    for name, (layers, width) in step.pool_shapes().items():
        shape = PoolLayout(num_blocks=num_blocks, layers=layers, block_size=block_size, width=width).shape
        feeds[name] = torch.randn(shape, generator=g) * 0.5
    if io.DRAFT_PROBS in step.input_names:                           # q of the drafts: some sampled rows
        feeds[io.DRAFT_PROBS] = torch.softmax(torch.randn(batch, k, vocab, generator=g), dim=-1)
    if step.structured_output:
        words = -(-vocab // 32)
        feeds[io.TOKEN_BITMASK] = torch.full((batch, k + 1, words), -1, dtype=torch.int32)
    return feeds


def dynamic_shapes(names: Sequence[str]) -> tuple[tuple[dict[int, object], ...]]:
    """torch.export dims per input, keyed by the contract's names."""
    dim = torch.export.Dim
    tokens, batch = dim("num_tokens", min=2), dim("batch", min=2)
    # max_blocks >= 2 as the exporter would refine it: declared >= 1, the trace's guard `!= 1` fails torch.export
    # and the exporter traced the whole step again with the refined bound (the graphs are the same)
    max_blocks, num_blocks = dim("max_blocks", min=2), dim("num_blocks", min=2)
    per_batch = {io.CACHE_LENGTHS, io.CHUNK_NEXT_TOKENS, io.TEMPERATURE, io.TOP_K, io.TOP_P, io.MIN_P,
                 io.IN_THINKING_PHASE, io.DRAFT_TOKENS, io.NOISE, io.TOKEN_BITMASK, io.DRAFT_PROBS}
    shapes: list[dict[int, object]] = []
    for name in names:
        if name in (io.TOKENS, io.POSITIONS):
            shapes.append({0: tokens})
        elif name == io.ROW_OFFSETS:
            shapes.append({0: batch + 1})
        elif name == io.BLOCK_TABLE:
            shapes.append({0: batch, 1: max_blocks})
        elif name in per_batch:
            shapes.append({0: batch})
        else:                                                        # a KV pool
            shapes.append({0: num_blocks})
    return (tuple(shapes),)


def save_streamed(model: ir.Model, path: Path, *, append: bool = False) -> None:
    """`path` (the graph) + `path`.data (every initializer), one tensor at a time, in initializer order;
    `append`: initializers already in the data file stay where they are, the others are added after them.

    A weight that is a view of a checkpoint file's map (export/checkpoint.py file_region) is copied from
    that file in chunks, so it never becomes resident; any other tensor is written from memory. The
    initializers then point at their bytes (location, offset, length) and the graph alone is serialized:
    nothing here holds a second copy of the weights.
    """
    import onnx_ir as ir

    from export.onnx_files import EXTERNAL_MIN_BYTES

    location = path.name + ".data"
    with open(path.parent / location, "ab" if append else "wb") as data:
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or isinstance(tensor, (ir.ExternalTensor, ir.StringTensor)):
                continue
            if tensor.nbytes < EXTERNAL_MIN_BYTES:   # shape constants stay inline: ONNX shape inference reads them
                continue
            raw = getattr(tensor, "raw", None)       # torch.onnx's TorchTensor wraps the module's tensor
            offset, length = append_weight(data, raw if isinstance(raw, torch.Tensor) else None, tensor.tobytes)
            value.const_value = ir.ExternalTensor(location, offset, length, tensor.dtype,
                                                  shape=tensor.shape, name=value.name, base_dir=path.parent)
    ir.save(model, path)


def append_weight(out: BinaryIO, tensor: torch.Tensor | None, to_bytes: Callable[[], bytes]) -> tuple[int, int]:
    """One weight appended to the open data file `out`: copied from its checkpoint file in chunks when
    `tensor` is a view of one (export/checkpoint.py file_region), else `to_bytes()`. Returns (offset, length)."""
    from export.checkpoint import file_region

    region = file_region(tensor) if tensor is not None else None
    offset = out.tell()
    if region is None:
        out.write(to_bytes())
    else:
        copy_region(*region, out)
    return offset, out.tell() - offset


def copy_region(source: Path, offset: int, length: int, out: BinaryIO) -> None:
    """Append `length` bytes of `source` from `offset` to the open file `out`, CHUNK_BYTES at a time."""
    from export.onnx_files import CHUNK_BYTES

    with open(source, "rb") as file:
        file.seek(offset)
        left = length
        while left:
            chunk = file.read(min(left, CHUNK_BYTES))
            if not chunk:
                raise OSError(f"{source} ended {left} bytes early (it changed during the export)")
            out.write(chunk)
            left -= len(chunk)


def write_onnx(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: str | Path, *,
               input_names: Sequence[str], output_names: Sequence[str], dynamic_shapes: object,
               finish: bool = True) -> Path:
    """Export any module that may call unispec custom ops (opset 24, IR 10) and save it at `path`, its
    initializers in `path`.data (save_streamed).

    Custom ops (plugins/) become single `unispec` nodes; their reference functions are attached after the
    export, because the exporter inlines every function it is given (DESIGN.md §4). `finish=False` saves the
    graph as traced, neither optimized nor with functions: export/stamp.py adds layers, then calls
    `finish_graph`.
    """
    from export.one_trace import one_trace

    with one_trace():                      # torch.onnx.export without its second trace where it is not needed
        program = torch.onnx.export(module.eval(), args, dynamo=True, opset_version=OPSET,
                                    input_names=list(input_names), output_names=list(output_names),
                                    dynamic_shapes=dynamic_shapes, verbose=False, optimize=False,
                                    custom_translation_table=plugins.custom_translation_table())
    if finish:
        _finish(program.model)
    save_streamed(program.model, Path(path))
    return Path(path)


def finish_graph(path: Path) -> None:
    """What write_onnx leaves out with `finish=False`, done to the graph saved at `path`; constants the
    optimizer makes are appended to the data file."""
    import onnx_ir as ir

    model = ir.load(path)                        # weights stay in the data file, read only where folded
    _finish(model)
    save_streamed(model, path, append=True)


def _finish(model: ir.Model) -> None:
    """The exporter's optimizer (what `torch.onnx.export(optimize=True)` runs: folding, common subexpressions,
    rewrites) without its O(N²) rule (plugins/onnx_optimizer.py), then the custom ops' functions."""
    from onnxscript import optimizer

    with fast_rules():
        optimizer.optimize_ir(model)
    plugins.attach_functions_ir(model)


def write_step(step: UnifiedStep, path: str | Path, feeds: dict[str, torch.Tensor] | None = None, *,
               finish: bool = True) -> Path:
    """Write `step` as ONNX at `path` with the contract's names and dynamic dimensions (`finish`: as in
    write_onnx)."""
    feeds = feeds or example_feeds(step)
    names = list(step.input_names)
    return write_onnx(step, tuple(feeds[n] for n in names), path, input_names=names,
                      output_names=step.output_names, dynamic_shapes=dynamic_shapes(names), finish=finish)
