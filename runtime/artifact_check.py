"""An artifact checked before the runtime allocates anything for it.

Loading a manifest checks each field's type and bounds (runtime/manifest.py). This module checks what
needs the directory and the graph, so that a damaged or edited artifact fails in one line naming what is
wrong, instead of a raw ONNX Runtime error at the first step or an allocation the kernel kills:

  paths    every file the manifest names resolves inside the artifact directory (symlinks followed)
  graph    model.onnx's declared inputs/outputs equal the manifest's tensor specs, and the contract
           shapes (DESIGN.md §3) built from the manifest's fields equal them too: K, block_size, each
           pool's layers / width / dtype, noise channels, structured output, vocab_size (also against
           the rows of the graph's token embedding), so the message names the field that disagrees
  memory   the persistent host buffers that the artifact's step sizes need fit a budget, and the KV
           pools fit the machine's memory, both computed before anything is allocated
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from runtime import manifest as io
from runtime.errors import ArtifactError, InvalidRequestError
from runtime.manifest import Manifest, dim_value, dtype_bytes

__all__ = ["DEFAULT_STEP_MEMORY_BYTES", "Graph", "check_artifact", "check_paths", "check_pool_memory",
           "check_step_memory", "host_memory_bytes", "read_graph", "step_buffer_bytes"]

DEFAULT_STEP_MEMORY_BYTES = 8 * 2**30
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 9: "bool"}
# two assignments of the dynamic dims: shapes that agree under both are the same expressions
_SAMPLE_DIMS = ({"batch": 3, "num_tokens": 5, "max_blocks": 7, "num_blocks": 11},
                {"batch": 13, "num_tokens": 17, "max_blocks": 19, "num_blocks": 23})
_REQUIRED_INPUTS = (io.TOKENS, io.ROW_OFFSETS, io.POSITIONS, io.CACHE_LENGTHS, io.BLOCK_TABLE, io.DRAFT_TOKENS)
_REQUIRED_OUTPUTS = (io.NUM_ACCEPTED, io.NEXT_TOKENS, io.NEXT_DRAFT_TOKENS)
_REEXPORT = "the manifest was edited or belongs to another export: re-export the artifact"

Spec = tuple[str, tuple[int | str, ...]]            # (dtype, shape) as the graph declares it


class Graph(NamedTuple):
    inputs: dict[str, Spec]
    outputs: dict[str, Spec]
    embedding_rows: int | None                      # the token embedding's vocabulary; None if not found


def check_artifact(directory: str | Path, manifest: Manifest) -> Graph:
    """Paths, then manifest against graph; a one-line ArtifactError for the first disagreement."""
    directory = Path(directory)
    check_paths(directory, manifest)
    graph = read_graph(directory / manifest.model_file)
    check_against_graph(manifest, graph)
    return graph


def check_paths(directory: Path, manifest: Manifest) -> None:
    """Every file the manifest names (io.named_files) lies inside `directory` once symlinks are followed;
    a one-line ArtifactError naming the field otherwise. (Manifest.load already refused names with a
    directory part, so only a link can lead out.)"""
    root = directory.resolve()
    for field_name, name in io.named_files(manifest):
        path = directory / name if isinstance(name, str) else None
        if path is None or not (path.exists() or path.is_symlink()):
            continue                             # absent: the check that reads the file names it
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError):          # a symlink loop (Python 3.11 raises RuntimeError)
            raise ArtifactError(f"manifest: {field_name} names {name}, a symbolic link that loops back on itself; "
                                "the artifact is damaged, re-export it") from None
        if not resolved.is_relative_to(root):
            raise ArtifactError(f"manifest: {field_name} names {name}, which resolves to {resolved}, outside the "
                                f"artifact directory {directory}; every file an artifact names must lie inside "
                                "it, re-export it")


# --- the graph ------------------------------------------------------------------------------------------------

def read_graph(path: Path) -> Graph:
    """model.onnx's declared inputs/outputs and token-embedding rows, without loading its weights."""
    import onnx
    from google.protobuf.message import DecodeError

    if not path.is_file():
        raise ArtifactError(f"{path.parent}: no {path.name}; the artifact is damaged, re-export it")
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except (DecodeError, OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ArtifactError(f"{path}: not a readable ONNX model ({reason}); the artifact is damaged, "
                            "re-export it") from None
    specs = [{v.name: _spec(v) for v in values} for values in (graph.input, graph.output)]
    return Graph(specs[0], specs[1], _embedding_rows(graph))


def _spec(value: Any) -> Spec:
    kind = value.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or f"{value.name}_{i}")
                  for i, d in enumerate(kind.shape.dim))
    return _ONNX_DTYPES.get(kind.elem_type, f"onnx type {kind.elem_type}"), shape


def _embedding_rows(graph: Any) -> int | None:
    """Rows of the first 2-D initializer gathered by values computed from `tokens` (not from its shape)."""
    tables = {t.name: t.dims[0] for t in graph.initializer if len(t.dims) == 2}
    from_tokens = {io.TOKENS}
    for node in graph.node:                          # topological order
        if node.op_type in ("Shape", "Size"):
            continue
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in tables \
                and node.input[1] in from_tokens:
            return int(tables[node.input[0]])
        if any(name in from_tokens for name in node.input):
            from_tokens.update(node.output)
    return None


def check_against_graph(manifest: Manifest, graph: Graph) -> None:
    for kind, listed, declared in (("inputs", manifest.inputs, graph.inputs),
                                   ("outputs", manifest.outputs, graph.outputs)):
        _same_names(kind, [t.name for t in listed], declared)
        for spec in listed:
            if not _same_spec((spec.dtype, spec.shape), declared[spec.name]):
                raise ArtifactError(f"manifest: {kind}[{spec.name!r}] is {spec.dtype} {list(spec.shape)} but the "
                                    f"graph declares {_shown(declared[spec.name])}; {_REEXPORT}")
    _check_fields(manifest, graph)


def _same_names(kind: str, listed: list[str], declared: Mapping[str, Spec]) -> None:
    missing, extra = sorted(set(listed) - set(declared)), sorted(set(declared) - set(listed))
    if missing:
        raise ArtifactError(f"manifest: {kind} {missing} are not in the graph; {_REEXPORT}")
    if extra:
        raise ArtifactError(f"manifest: {kind} do not list the graph's {extra}; {_REEXPORT}")


def _check_fields(m: Manifest, graph: Graph) -> None:
    required = [(name, graph.inputs) for name in _REQUIRED_INPUTS] + [(n, graph.outputs) for n in _REQUIRED_OUTPUTS]
    required += [(p.delta, graph.outputs) for p in m.pools]
    absent = [name for name, declared in required if name not in declared]
    if absent:
        raise ArtifactError(f"the graph lacks {absent}, which every step graph has (DESIGN.md §3); {_REEXPORT}")
    unpooled = [n for n in graph.inputs if n in io.DELTA_OF_POOL and n not in {p.name for p in m.pools}]
    if unpooled:
        raise ArtifactError(f"manifest: pools do not list the graph's pool inputs {unpooled}; {_REEXPORT}")
    if m.structured_output and io.TOKEN_BITMASK not in graph.inputs:   # (a bitmask left unused is harmless)
        raise ArtifactError(f"manifest: structured_output is True but the graph lacks {io.TOKEN_BITMASK}; "
                            f"{_REEXPORT}")
    for name, (dtype, dims) in _contract(m).items():
        declared = graph.inputs.get(name) or graph.outputs.get(name)
        if declared is not None:
            _check_contract(m, name, dtype, dims, declared)
    if graph.embedding_rows is not None and graph.embedding_rows != m.vocab_size:
        raise ArtifactError(f"manifest: vocab_size is {m.vocab_size} but the graph's token embedding has "
                            f"{graph.embedding_rows} rows; {_REEXPORT}")


# a contract dim: (the manifest field it comes from, or "" for a dynamic dim; its value or expression)
Dim = tuple[str, int | str]


def _contract(m: Manifest) -> dict[str, tuple[tuple[str, str], list[Dim]]]:
    """tensor -> ((dtype field, dtype), dims) as DESIGN.md §3 derives them from the manifest's fields."""
    k, batch = ("num_speculative_tokens", m.num_speculative_tokens), ("", "batch")
    k1 = ("num_speculative_tokens", m.num_speculative_tokens + 1)
    rows = [(name, (("", dtype), [batch])) for name, dtype in (
        (io.CACHE_LENGTHS, "int64"), (io.CHUNK_NEXT_TOKENS, "int64"), (io.TEMPERATURE, "float32"),
        (io.TOP_K, "int64"), (io.TOP_P, "float32"), (io.MIN_P, "float32"), (io.IN_THINKING_PHASE, "bool"),
        (io.NUM_ACCEPTED, "int64"), (io.NEXT_TOKENS, "int64"))]
    contract = dict(rows)
    contract.update({
        io.TOKENS: (("", "int64"), [("", "num_tokens")]), io.POSITIONS: (("", "int64"), [("", "num_tokens")]),
        io.ROW_OFFSETS: (("", "int64"), [("", "batch + 1")]),
        io.BLOCK_TABLE: (("", "int64"), [batch, ("", "max_blocks")]),
        io.DRAFT_TOKENS: (("", "int64"), [batch, k]), io.NEXT_DRAFT_TOKENS: (("", "int64"), [batch, k]),
        io.NOISE: (("", "float32"), [batch, k1, ("noise_channels", m.noise_channels)]),
        io.TOKEN_BITMASK: (("", "int32"), [batch, k1, ("vocab_size", -(-m.vocab_size // 32))]),
    })
    merged = ("", f"{m.num_speculative_tokens}*batch + num_tokens")
    for i, p in enumerate(m.pools):
        layers, width = (f"pools[{i}].num_layers", p.num_layers), (f"pools[{i}].width", p.width)
        dtype = (f"pools[{i}].dtype", p.dtype)
        contract[p.name] = (dtype, [("", "num_blocks"), layers, ("block_size", m.block_size), width])
        contract[p.delta] = (dtype, [merged, layers, width])
    return contract


def _check_contract(m: Manifest, name: str, dtype: tuple[str, str], dims: list[Dim], declared: Spec) -> None:
    (dtype_field, want), (got, shape) = dtype, declared
    if got != want:
        raise ArtifactError(_disagree(m, dtype_field, f"{name} is {got}, the contract says {want}"))
    if len(shape) != len(dims):
        raise ArtifactError(_disagree(m, "", f"{name} is {_shown(declared)}, the contract has {len(dims)} dims"))
    for i, ((field_name, expected), dim) in enumerate(zip(dims, shape)):
        if not _same_dim(expected, dim):
            raise ArtifactError(_disagree(m, field_name, f"{name} has {dim!r} at dim {i}, where the manifest's "
                                                         f"fields give {expected!r}"))


def _disagree(m: Manifest, field_name: str, detail: str) -> str:
    if not field_name:
        return f"the graph does not follow the step contract (DESIGN.md §3): {detail}; {_REEXPORT}"
    value = getattr(m, field_name, None) if "[" not in field_name else _pool_field(m, field_name)
    return f"manifest: {field_name} is {value!r} but the graph disagrees: {detail}; {_REEXPORT}"


def _pool_field(m: Manifest, field_name: str) -> object:
    index, attr = field_name[len("pools["):].split("].")
    return getattr(m.pools[int(index)], attr)


def _same_dim(a: int | str, b: int | str) -> bool:
    return all(dim_value(a, env) == dim_value(b, env) for env in _SAMPLE_DIMS)


def _same_spec(a: Spec, b: Spec) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(_same_dim(x, y) for x, y in zip(a[1], b[1]))


def _shown(spec: Spec) -> str:
    return f"{spec[0]} {list(spec[1])}"


# --- memory ---------------------------------------------------------------------------------------------------

def step_buffer_bytes(m: Manifest) -> int:
    """Host bytes of the persistent per-step buffers sized from the manifest (runtime/backend.py): the host
    loop's input buffers, a backend's own copy of them and its output buffers, and the positions table."""
    bounds = {"batch": m.max_batch_size, "num_tokens": m.max_tokens_per_step, "max_blocks": m.blocks_per_row()}
    pools = {p.name for p in m.pools}

    def size(specs: tuple[io.TensorSpec, ...]) -> int:
        return sum(math.prod(dim_value(d, bounds, tensor=s.name) for d in s.shape) * dtype_bytes(s.dtype)
                   for s in specs if s.name not in pools)

    return 2 * size(m.inputs) + size(m.outputs) + 8 * (m.max_model_len + 2 * m.num_speculative_tokens + 2)


def check_step_memory(m: Manifest, budget: int | None = None) -> int:
    """The step buffers' bytes; a one-line ArtifactError when they exceed `budget` (default 8 GiB)."""
    budget = DEFAULT_STEP_MEMORY_BYTES if budget is None else budget
    need = step_buffer_bytes(m)
    if need > budget:
        raise ArtifactError(f"this artifact's step sizes (max_batch_size {m.max_batch_size}, max_tokens_per_step "
                            f"{m.max_tokens_per_step}, max_model_len {m.max_model_len}, K "
                            f"{m.num_speculative_tokens}) need {_gib(need)} of persistent host buffers, above the "
                            f"{_gib(budget)} budget; re-export with a smaller --max-batch-size / "
                            "--max-tokens-per-step, or raise step_memory_bytes")
    return need


def check_pool_memory(m: Manifest, num_blocks: int, other_bytes: int = 0) -> None:
    """KV pools held in host memory must fit the machine (with `other_bytes` beside them)."""
    need = num_blocks * m.block_size * m.kv_bytes_per_token()
    total = host_memory_bytes()
    if total is not None and need + other_bytes > total:
        raise InvalidRequestError(f"num_blocks={num_blocks} needs {_gib(need)} of KV pools, more than this "
                                  f"machine's {_gib(total)} of memory; lower num_blocks or kv_memory_bytes")


def host_memory_bytes() -> int | None:
    """Physical memory, or the cgroup's limit when lower; None where neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB" if num_bytes < 2**40 else f"{num_bytes / 2**40:.3g} TiB"
