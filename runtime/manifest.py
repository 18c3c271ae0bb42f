"""The artifact contract shared by export, engines and runtime: graph input/output names (DESIGN.md §3).

Owned by the runtime (it is what the runtime reads); `export` and `engines` import this module and
only the leaves errors, noise and pool_layout besides. Every name below is the exact ONNX value name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.errors import ArtifactError

# the bounds live in runtime/limits.py; named here too, as export and engines read only this module of ours
from runtime.limits import (  # noqa: F401
    DRAFTERS,
    FLOAT_DTYPES,
    MAX_BATCH_SIZE,
    MAX_BLOCK_DRAFT_TOKENS,
    MAX_BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_SPECULATIVE_TOKENS,
    MAX_TOKENS_PER_STEP,
    SIZES,
    Drafter,
    check_layout,
    is_int,
    max_speculative_tokens,
    plain_name,
    require,
)

# --- inputs -------------------------------------------------------------------------------------------
TOKENS = "tokens"                        # int64 [S]
ROW_OFFSETS = "row_offsets"              # int64 [B+1]
POSITIONS = "positions"                  # int64 [S]
CACHE_LENGTHS = "cache_lengths"          # int64 [B]
BLOCK_TABLE = "block_table"              # int64 [B, max_blocks]
DRAFT_TOKENS = "draft_tokens"            # int64 [B, K]; -1 = no drafts for that row
KV_POOL = "kv_pool"                      # [num_blocks, L, block_size, W]
FULL_KV_POOL = "full_kv_pool"            # Gemma 4: full-attention layers' pool when head dims differ
DRAFT_KV_POOL = "draft_kv_pool"          # [num_blocks, Ld, block_size, Wd]
CHUNK_NEXT_TOKENS = "chunk_next_tokens"  # int64 [B]; -1 unless the row's prompt continues next step
TEMPERATURE = "temperature"              # f32 [B]
TOP_K = "top_k"                          # int64 [B]
TOP_P = "top_p"                          # f32 [B]
MIN_P = "min_p"                          # f32 [B]
NOISE = "noise"                          # f32 [B, K+1, C]
IN_THINKING_PHASE = "in_thinking_phase"  # bool [B]
TOKEN_BITMASK = "token_bitmask"          # int32 [B, K+1, ceil(V/32)] (structured-output artifacts only)
# f32 [B, K, V]: q_i that draft_tokens[b, i] was sampled from (the last step's next_draft_probs). K >= 1
# graphs since sampled drafts; older artifacts lack it and verify argmax drafts by sample-and-match.
DRAFT_PROBS = "draft_probs"

# --- outputs ------------------------------------------------------------------------------------------
NUM_ACCEPTED = "num_accepted"            # int64 [B]
NEXT_TOKENS = "next_tokens"              # int64 [B]
NEXT_DRAFT_TOKENS = "next_draft_tokens"  # int64 [B, K]
NEXT_DRAFT_PROBS = "next_draft_probs"    # f32 [B, K, V]: q of next_draft_tokens (greedy rows: onehot or 0)
KV_DELTA = "kv_delta"                    # [S + B*K, L, W]
FULL_KV_DELTA = "full_kv_delta"          # [S + B*K, L_full, W_full] (Gemma 4)
DRAFT_KV_DELTA = "draft_kv_delta"        # [S + B*K, Ld, Wd]
# The target's raw log-softmax at each verified position j (artifacts with max_logprobs N >= 1): the emitted
# token is draft j for j < num_accepted, next_tokens at j == num_accepted; the host ignores later positions.
EMITTED_LOGPROBS = "emitted_logprobs"    # f32 [B, K+1] log p of the emitted token
EMITTED_RANKS = "emitted_ranks"          # int64 [B, K+1] its 1-based rank in the target's distribution
TOP_LOGPROBS = "top_logprobs"            # f32 [B, K+1, N] the N largest log p, descending
TOP_LOGPROB_IDS = "top_logprob_ids"      # int64 [B, K+1, N] their token ids
LOGPROB_OUTPUTS = (EMITTED_LOGPROBS, EMITTED_RANKS, TOP_LOGPROBS, TOP_LOGPROB_IDS)
MAX_LOGPROBS = 20                        # N at most (OpenAI's top_logprobs bound, vLLM's default max_logprobs)
# N of an export that does not say (`unispec export --max-logprobs`): on the bundled Llama 3 the outputs
# cost under 2% of a step (measured with ORT, 1 thread; docs/architecture.md)
DEFAULT_MAX_LOGPROBS = 5

# Each pool input and the delta output whose rows the runtime commits into it.
DELTA_OF_POOL = {KV_POOL: KV_DELTA, FULL_KV_POOL: FULL_KV_DELTA, DRAFT_KV_POOL: DRAFT_KV_DELTA}

SAMPLING_INPUTS = (TEMPERATURE, TOP_K, TOP_P, MIN_P, NOISE, IN_THINKING_PHASE)


# --- the manifest ----------------------------------------------------------------------------------------
# `manifest.json` describes an artifact completely: the runtime reads nothing else (no model code).

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MODEL_NAME = "model.onnx"
WEIGHTS_NAME = "model.onnx.data"
ORT_MODEL_NAME = "model.ort.onnx"         # the same graph, lowered for ONNX Runtime (engines/ort)
# Manifest.graphs: graph -> {PORTABLE: the ONNX graph `export` wrote, backend name (runtime/backends
# BACKENDS): the file its engines/<backend> build derived from that}
STEP, TARGET_ONLY, PORTABLE = "step", "target_only", "portable"
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One graph input or output: dims are ints (static) or names (dynamic: num_tokens, batch, ...)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ArtifactError(f"manifest: tensor '{self.name}' has dtype {self.dtype!r}; expected one of {DTYPES}")


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """A paged KV pool input [num_blocks, num_layers, block_size, width] and the delta output committed into it."""

    name: str
    delta: str
    num_layers: int
    width: int
    dtype: str

    def bytes_per_token(self) -> int:
        return self.num_layers * self.width * _DTYPE_BYTES[self.dtype]


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    files: tuple[str, ...] = ()              # copied next to the model (tokenizer.json, tokenizer_config.json ...)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    think_start_id: int | None = None        # thinking-phase tracking (relaxed acceptance), when known
    think_end_id: int | None = None


@dataclass(frozen=True, kw_only=True)
class TargetOnlyGraph:
    """A speculative artifact's second graph (adaptive speculation): its target decoding one token per row
    (the target's `none` graph). K = 0: draft_tokens [B, 0], noise [B, 1, C], no draft_probs; the target's
    pools only (the draft pool is left as it is), deltas S rows long; weights in the same file."""

    inputs: tuple[TensorSpec, ...]          # its files: Manifest.graphs[TARGET_ONLY]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    format_version: int = FORMAT_VERSION
    method: str                              # none | mtp | nextn | eagle3 | eagle3-mha | dflash | gemma4-mtp
    num_speculative_tokens: int              # K (0 for `none`)
    target_arch: str
    draft_arch: str | None = None
    drafter: Drafter | None = None           # the method's kind (DRAFTERS); None: written before it was recorded
    vocab_size: int
    dtype: str                               # weights / activations
    block_size: int
    max_model_len: int                       # longest sequence a request may reach
    max_batch_size: int                      # rows per step (TensorRT profiles; runtime scheduler bound)
    max_tokens_per_step: int                 # S bound (prefill chunk budget; TensorRT profiles)
    noise_channels: int
    structured_output: bool = False          # graph has `token_bitmask`
    max_logprobs: int = 0                    # N of the LOGPROB_OUTPUTS (0: none, as in artifacts before them)
    pools: tuple[PoolSpec, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    ops: tuple[str, ...] = ()                # unispec custom ops in the graph
    # STEP always, TARGET_ONLY with target_only; older manifests' model_file / ort_model_file map here
    graphs: dict[str, dict[str, str]] = field(default_factory=lambda: {STEP: {PORTABLE: MODEL_NAME}})
    weights_file: str | None = WEIGHTS_NAME
    tokenizer: TokenizerInfo = field(default_factory=TokenizerInfo)
    exporter: dict[str, str] = field(default_factory=dict)   # package -> version
    # absolute checkpoint directories exported from (provenance; `unispec bench` loads them for its peers);
    # None when unknown (manifests written before these fields) or, for the draft, when there is none
    target_checkpoint: str | None = None
    draft_checkpoint: str | None = None
    engine: dict[str, Any] | None = None     # written by `unispec build` (issue 8)
    # the target-only graph a speculative artifact also carries; None for `none` and older artifacts
    target_only: TargetOnlyGraph | None = None
    quantization: dict[str, Any] | None = None   # export/quantization.py: RTN, fp8, awq/gptq (+ "draft"); None: float

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ArtifactError(f"manifest: format_version {self.format_version} is not {FORMAT_VERSION}; "
                                "re-export the artifact with this unispec version")
        names = {t.name for t in self.inputs}
        missing = [p.name for p in self.pools if p.name not in names]
        if missing:
            raise ArtifactError(f"manifest: pools {missing} are not graph inputs; the artifact is damaged, re-export it")
        check_fields(self)

    @property
    def model_file(self) -> str:
        """The portable step graph (model.onnx): what TensorRT builds and every check reads."""
        return self.graphs[STEP][PORTABLE]

    def graph_file(self, graph: str, backend: str) -> str | None:
        """`backend`'s file of `graph` (STEP or TARGET_ONLY), or None when it has none."""
        return self.graphs.get(graph, {}).get(backend)

    def blocks_per_row(self, context_len: int | None = None) -> int:
        """Block-table width of a row with `context_len` tokens (default max_model_len), its step reach included."""
        length = self.max_model_len if context_len is None else context_len
        return blocks_per_row(length, num_speculative_tokens=self.num_speculative_tokens, block_size=self.block_size)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies across every pool (target + draft): the unit of pool sizing."""
        return sum(p.bytes_per_token() for p in self.pools)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write(self, directory: str | Path) -> Path:
        (path := Path(directory) / MANIFEST_NAME).write_text(self.to_json() + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        try:
            d = _graph_map(dict(d))
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(d) - known)
            if unknown:
                raise ArtifactError(f"manifest: unknown fields {unknown}; the artifact was written by a newer "
                                    "unispec, upgrade or re-export")
            check_layout(d)
            d["pools"] = tuple(PoolSpec(**p) for p in d["pools"])
            d["inputs"], d["outputs"] = _tensor_specs(d["inputs"]), _tensor_specs(d["outputs"])
            if d.get("target_only") is not None:
                only = {k: v for k, v in d["target_only"].items() if k not in _OLD_FILE_FIELDS}
                only["inputs"], only["outputs"] = _tensor_specs(only["inputs"]), _tensor_specs(only["outputs"])
                d["target_only"] = TargetOnlyGraph(**only)
            d["ops"] = tuple(d.get("ops", ()))
            tok = dict(d.get("tokenizer") or {})
            tok["files"], tok["eos_token_ids"] = tuple(tok.get("files", ())), tuple(tok.get("eos_token_ids", ()))
            d["tokenizer"] = TokenizerInfo(**tok)
            return cls(**d)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"manifest: missing or malformed field ({exc}); the artifact is damaged, "
                                "re-export it") from None

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read and validate `manifest.json` of an artifact directory (one-line ArtifactError otherwise)."""
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise ArtifactError(f"{directory}: no {MANIFEST_NAME}; not a unispec artifact (run `unispec export`)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path}: not valid JSON ({exc.msg}); the artifact is damaged, re-export it") from None
        if not isinstance(d, dict):
            raise ArtifactError(f"{path}: must hold a JSON object; the artifact is damaged, re-export it")
        return cls.from_dict(d)


# the fields that named graph files before the graph map: field -> the map's key
_OLD_FILE_FIELDS = {"model_file": PORTABLE, "ort_model_file": "ort"}


def _graph_map(d: dict[str, Any]) -> dict[str, Any]:
    """A manifest written before the graph map (model_file, defaulting to model.onnx, and ort_model_file, at
    the top and in target_only): its files moved into `graphs`, as export writes them now, so artifacts
    already on disk keep running."""
    if "graphs" in d:
        return d
    only = d.get(TARGET_ONLY)
    old = {STEP: {"model_file": MODEL_NAME, **d}, **({TARGET_ONLY: only} if isinstance(only, dict) else {})}
    d["graphs"] = {graph: {key: files[name] for name, key in _OLD_FILE_FIELDS.items() if files.get(name) is not None}
                   for graph, files in old.items()}
    for name in _OLD_FILE_FIELDS:
        d.pop(name, None)
    return d


def _tensor_specs(items: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name=t["name"], dtype=t["dtype"], shape=tuple(t["shape"])) for t in items)


def dim_value(dim: int | str, env: Mapping[str, int], *, tensor: str | None = None) -> int:
    """A manifest dim (an int, a name, or a sum of products such as '3*batch + num_tokens') under `env`."""
    if isinstance(dim, int):
        return dim
    total = 0
    for term in dim.split("+"):
        product = 1
        for factor in (f.strip() for f in term.split("*")):
            if factor.isdigit():
                product *= int(factor)
            elif factor in env:
                product *= env[factor]
            else:
                where = f"tensor {tensor!r} has " if tensor else ""
                raise ArtifactError(f"manifest: {where}dimension {dim!r} naming {factor!r}, which this unispec "
                                    f"does not know (known: {', '.join(sorted(env))}); re-export the artifact "
                                    "with this unispec version")
        total += product
    return total


# --- step geometry (DESIGN.md §3; the commit rule is runtime/pool_layout.py's) ---------------------------
# One home: the scheduler, the persistent buffers, the engine profiles and every backend read it from here.

def step_reach(num_speculative_tokens: int) -> int:
    """Positions a step may write past a row's cache and new tokens: the K merged drafts, and the K - 1
    sequential draft steps after them plus one slot for the draft of the bonus position: 2K + 1. A row's
    block table must cover them even though only accepted rows are ever committed."""
    return 2 * num_speculative_tokens + 1


def blocks_per_row(context_len: int, *, num_speculative_tokens: int, block_size: int) -> int:
    """Blocks a row of `context_len` committed + new tokens needs for one step (its reach included)."""
    return -(-(context_len + step_reach(num_speculative_tokens)) // block_size)


# --- field checks ----------------------------------------------------------------------------------------------
# Types and bounds of every field (runtime/limits.py), checked when a manifest is built or loaded.

def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a manifest dtype."""
    return _DTYPE_BYTES[dtype]


def check_fields(m: Manifest) -> None:
    """Every field has its type and lies within its bounds; a one-line ArtifactError naming the field."""
    for name in ("method", "target_arch"):
        require(name, getattr(m, name), isinstance(getattr(m, name), str), "a string")
    require("draft_arch", m.draft_arch, m.draft_arch is None or isinstance(m.draft_arch, str), "a string or null")
    require("dtype", m.dtype, m.dtype in FLOAT_DTYPES, f"one of {', '.join(FLOAT_DTYPES)}")
    require("structured_output", m.structured_output, isinstance(m.structured_output, bool), "true or false")
    require("max_logprobs", m.max_logprobs, is_int(m.max_logprobs) and 0 <= m.max_logprobs <= MAX_LOGPROBS,
            f"an int in [0, {MAX_LOGPROBS}]")
    require("drafter", m.drafter, m.drafter is None or m.drafter in DRAFTERS, f"one of {', '.join(DRAFTERS)}")
    k_limit = max_speculative_tokens(m.drafter)
    for name, (lowest, highest) in (*SIZES.items(), ("num_speculative_tokens", (0, k_limit))):
        value = getattr(m, name)
        require(name, value, is_int(value) and lowest <= value <= highest, f"an int in [{lowest}, {highest}]")
    for i, pool in enumerate(m.pools):
        _check_pool(f"pools[{i}]", pool)
    for kind, specs in (("inputs", m.inputs), ("outputs", m.outputs)):
        for spec in specs:
            dims_ok = isinstance(spec.shape, tuple) and all(
                (is_int(d) and d >= 0) or (isinstance(d, str) and d.strip()) for d in spec.shape)
            require(f"{kind}[{spec.name!r}].shape", spec.shape, isinstance(spec.name, str) and dims_ok,
                    "a list of dims, each an int >= 0 or a dim name")
    _check_files(m)
    _check_token_ids(m)


def _check_pool(where: str, pool: PoolSpec) -> None:
    require(f"{where}.name", pool.name, pool.name in DELTA_OF_POOL, f"one of {', '.join(DELTA_OF_POOL)}")
    require(f"{where}.delta", pool.delta, pool.delta == DELTA_OF_POOL[pool.name], repr(DELTA_OF_POOL[pool.name]))
    for name in ("num_layers", "width"):
        value = getattr(pool, name)
        require(f"{where}.{name}", value, is_int(value) and value >= 1, "an int >= 1")
    require(f"{where}.dtype", pool.dtype, pool.dtype in FLOAT_DTYPES, f"one of {', '.join(FLOAT_DTYPES)}")


def artifact_files(m: Manifest) -> tuple[str, ...]:
    """Every file the manifest names, manifest.json first (plain names inside the artifact directory)."""
    return tuple(dict.fromkeys([MANIFEST_NAME, *(name for _, name in named_files(m) if name is not None)]))


def named_files(m: Manifest) -> list[tuple[str, object]]:
    """(field, file name or None) of every field that names a file: the one list both file checks confine."""
    engine = m.engine if isinstance(m.engine, dict) else {}
    graphs = [(f"graphs.{graph}.{key}", name) for graph, files in m.graphs.items() for key, name in files.items()]
    return [*graphs, ("weights_file", m.weights_file),
            *((f"tokenizer.files[{i}]", name) for i, name in enumerate(m.tokenizer.files)),
            ("engine.plan", engine.get("plan")), ("engine.settings", engine.get("settings"))]


def _check_files(m: Manifest) -> None:
    """Artifacts are flat: a plain name cannot point outside one (artifact_check.check_paths follows symlinks)."""
    require("engine", m.engine, m.engine is None or isinstance(m.engine, dict), "an object or null")
    require("tokenizer.files", m.tokenizer.files, isinstance(m.tokenizer.files, tuple), "a list of file names")
    _check_graph_map(m)
    for field_name, name in named_files(m):
        require(field_name, name, (name is None and not field_name.startswith("graphs.")) or plain_name(name),
                "a plain file name inside the artifact directory (no directory part, not absolute)")


def _check_graph_map(m: Manifest) -> None:
    """Each graph the manifest describes has its portable file, and the map names no other graph."""
    wanted = [STEP, *([TARGET_ONLY] if m.target_only is not None else [])]
    ok = isinstance(m.graphs, dict) and all(isinstance(f, dict) and PORTABLE in f for f in m.graphs.values())
    require("graphs", m.graphs, ok and sorted(m.graphs) == sorted(wanted),
            f"an object mapping {' and '.join(wanted)} to {{\"{PORTABLE}\": file, backend: file}}")


def _check_token_ids(m: Manifest) -> None:
    ids = [(name, getattr(m.tokenizer, name)) for name in ("bos_token_id", "think_start_id", "think_end_id")]
    ids += [("eos_token_ids", t) for t in m.tokenizer.eos_token_ids]
    for name, value in ids:
        require(f"tokenizer.{name}", value, value is None or (is_int(value) and 0 <= value < m.vocab_size),
                f"a token id in [0, {m.vocab_size})")
