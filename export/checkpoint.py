"""Lazy, memory-mapped access to the tensors of a Hugging Face checkpoint directory.

A `Checkpoint` is a `Mapping[str, Tensor]`: adapters (export/weights.py) pull one tensor at a time, so a
checkpoint far larger than RAM is never held twice. Each safetensors file is opened on first use (header
parsed, data memory-mapped) and kept open; a tensor's bytes are read only when that key is asked for.

Layouts understood, first match wins (repos often ship extra copies, e.g. `consolidated.safetensors`):
  model.safetensors.index.json  ->  weight_map {key: shard file}
  model.safetensors             ->  one file
  *.safetensors (no index)      ->  every file, keys must not repeat (draft heads ship like this)

DeepSeek block-FP8 checkpoints (`quantization_config.quant_method == "fp8"`) are dequantized as they are
read, so everything downstream sees plain floating tensors; each such tensor is remembered (export/fp8.py),
so a module that loaded it can put the FP8 codes back for the export (`keep_fp8`):

  weight  fp8 [R, C]     scale_inv  fp32 [ceil(R/br), ceil(C/bc)]
  out[r, c] = float(weight[r, c]) * scale_inv[r // br, c // bc]

AWQ / GPTQ int4 checkpoints (`quant_method` awq / gptq) show each quantized linear as a float `<p>.weight`
[N, K] dequantized when read, its packed `<p>.qweight/qzeros/scales/g_idx` hidden; export/awq_gptq.py keeps
the codes for the export. Any other quant_method is refused when the checkpoint is opened.

A tensor read in its stored dtype is a zero-copy view of the file's memory map (`torch.frombuffer` over
a private mapping), so a module built from it holds no copy of its weights; `file_region(tensor)` says
where such a tensor's bytes lie in the file, so an export can copy them from the file one tensor at a time
(export/onnx_export.py) instead of through memory. Casts and FP8 dequantization return new tensors.

Pickle files (`*.bin`, `*.pt`, ...) are refused: unpickling runs arbitrary code from the file.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import struct
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from export.awq_gptq import PER_WORD, Int4Format, int4_format, int4_weights, parts_of, read_int4
from export.awq_gptq import remember as remember_int4
from export.config import HFFields, check, read_config_json
from export.fp8 import Fp8Weight, remember
from export.hub import resolve_checkpoint
from runtime.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# safetensors header dtype names -> torch; the set torch can hold without loss.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}


class MissingTensorError(CheckpointError, KeyError):
    """A key the checkpoint does not hold; also a KeyError so `Mapping.get` and `in` keep their meaning."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-scaled FP8 -> float32; edge blocks of a shape not divisible by `block` are trimmed."""
    rows, cols = weight.shape                                                  # weight: [R, C] fp8
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows]           # [R, ceil(C/bc)]
    scale = scale.repeat_interleave(block[1], 1)[:, :cols]                     # [R, C]
    return weight.float() * scale


def _fp8_block(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) scale block of a DeepSeek-style FP8 checkpoint, or None when it is not one."""
    if not isinstance(config.get("quantization_config"), Mapping):
        return None
    fields = HFFields(config, what="config.json").sub("quantization_config")
    if fields.str("quant_method", "") != "fp8":
        return None
    fields.str("fmt", "e4m3", choices=("e4m3",))
    block = fields.list("weight_block_size")
    check(len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block),
          "config.json (quantization_config)",
          f"'weight_block_size' must be two positive integers [rows, cols], got {block!r}")
    return block[0], block[1]


def _no_duplicate_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key listed twice in an index would silently pick one shard."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise CheckpointError(f"key '{key}' is listed twice (in {seen[key]!r} and {value!r})")
        seen[key] = value
    return seen


def _read_index(root: Path) -> dict[str, Path]:
    """key -> shard path from `model.safetensors.index.json`, every shard checked to exist (a stat, no read)."""
    path = root / INDEX_NAME
    try:
        index = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_pairs)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                              "re-download it or regenerate the index") from None
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}; fix the index") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: needs a 'weight_map' object of key -> shard file name; fix the index")
    files: dict[str, Path] = {}
    for key, name in weight_map.items():
        shard = root / name
        # a name, not a path: '..' could reach any file (resolving would wrongly reject the HF cache's symlinks)
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path}: shard '{name}' of '{key}' lies outside {root}; fix the index")
        if not shard.is_file():
            raise CheckpointError(f"{path}: shard file '{name}' (holding '{key}') is missing from {root}; "
                                  "download it or fix the index")
        files[key] = shard
    return files


def _refuse_pickles(root: Path) -> None:
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{root}: only pickle weights here ({', '.join(pickles[:3])}); pickle files can run arbitrary "
            "code, so they are not loaded; convert them once in a trusted environment with "
            "`safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')`")


def _weight_files(root: Path) -> list[Path] | None:
    """The safetensors files of a directory without an index; None means 'use the index'."""
    if (root / INDEX_NAME).is_file():
        return None
    if (root / SINGLE_NAME).is_file():
        return [root / SINGLE_NAME]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        _refuse_pickles(root)
        raise CheckpointError(f"{root}: no *.safetensors weights here; point at a Hugging Face checkpoint "
                              "directory that has model.safetensors or a model.safetensors.index.json")
    return files


def _open_file(path: Path, key: str | None) -> Any:
    """Open one safetensors file (header + mmap only); a failure names the file and the key wanted."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        wanted = f" while reading '{key}'" if key else ""
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}){wanted}; it is truncated "
                              "or corrupt, re-download it") from None


class _Mapped:
    """One safetensors file mapped privately (copy-on-write: a stray in-place write never reaches the file)."""

    # live mappings, for file_region: base address -> (length, path); an entry goes when its map is freed
    by_address: dict[int, tuple[int, Path]] = {}

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            self.offsets = {k: v["data_offsets"] for k, v in json.loads(file.read(header_size)).items()
                            if k != "__metadata__"}
            self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        self.data_start = 8 + header_size
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        _Mapped.by_address[address] = (len(self.map), path)
        weakref.finalize(self.map, _Mapped.by_address.pop, address, None)

    def view(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        begin, end = self.offsets[key]
        count = (end - begin) // dtype.itemsize
        if count == 0:             # frombuffer refuses empty views
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=self.data_start + begin).view(shape)


def file_region(tensor: torch.Tensor) -> tuple[Path, int, int] | None:
    """(file, offset, length) of a tensor that is a contiguous view of a checkpoint file's map, else None.
    The file's bytes are the tensor's because checkpoint weights are never written in place (adapters are
    pure, modules run in eval): a write would land in a private copy-on-write page, not in the file."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    pointer, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    for address, (size, path) in list(_Mapped.by_address.items()):
        if address <= pointer and pointer + length <= address + size:
            return path, pointer - address, length
    return None


class _Store:
    """State shared by a checkpoint and its prefix views: key -> file, open handles, cast rules."""

    def __init__(self, root: Path, dtype: torch.dtype | None, fp8_block: tuple[int, int] | None,
                 int4: Int4Format | None = None) -> None:
        self.root = root
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.handles: dict[Path, Any] = {}
        self.maps: dict[Path, _Mapped] = {}
        files = _weight_files(root)
        self.files: dict[str, Path] = _read_index(root) if files is None else self._scan(files)
        self.searched = sorted({p.name for p in (files or self.files.values())})
        self.hidden = {k for k in self.files if fp8_block and k.endswith(SCALE_SUFFIX)
                       and k[: -len(SCALE_SUFFIX)] in self.files}
        self.int4_format = int4
        self.int4 = int4_weights(self.files, int4, root) if int4 is not None else {}   # '<p>.weight' -> '<p>'
        self.hidden |= parts_of(self.int4)
        self.keys = (*(k for k in self.files if k not in self.hidden), *self.int4)

    def _scan(self, files: list[Path]) -> dict[str, Path]:
        """Without an index the headers are the only key list; reading them does not touch tensor data."""
        owner: dict[str, Path] = {}
        for path in files:
            for key in self.handle(path).keys():
                if key in owner:
                    raise CheckpointError(f"{self.root}: tensor '{key}' is in both {owner[key].name} and "
                                          f"{path.name}; remove one copy")
                owner[key] = path
        return owner

    def handle(self, path: Path, key: str | None = None) -> Any:
        if path not in self.handles:
            self.handles[path] = _open_file(path, key)
        return self.handles[path]

    def missing(self, key: str) -> MissingTensorError:
        if key in self.hidden:
            base = key[: -len(SCALE_SUFFIX)]
            return MissingTensorError(f"{self.root}: '{key}' is the FP8 scale of '{base}'; it is applied "
                                      f"when '{base}' is read, ask for '{base}' instead")
        names = self.searched
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return MissingTensorError(f"{self.root}: no tensor '{key}' (searched {shown}); the checkpoint does "
                                  "not match what the adapter expects")

    def read(self, key: str) -> torch.Tensor:
        """The stored tensor of `key` (known to be in `files`); safetensors' errors re-raised naming the file."""
        path = self.files[key]
        try:
            return self.handle(path, key).get_tensor(key)
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{key}' ({exc}); re-download the file") from None

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(stored dtype, shape) of `key` (known to be in `files`) from the header alone; an AWQ / GPTQ
        weight is float32 [N, K] (its qweight's packed shape unfolded)."""
        if key in self.int4:
            _, packed = self.info(self.int4[key] + ".qweight")
            if len(packed) != 2:          # refused, naming the tensor, when it is read (read_int4)
                return torch.int32, packed
            awq = self.int4_format.method == "awq"
            return torch.float32, ((packed[1] * PER_WORD, packed[0]) if awq else (packed[1], packed[0] * PER_WORD))
        path = self.files[key]
        try:
            view = self.handle(path, key).get_slice(key)
            name, shape = view.get_dtype(), tuple(view.get_shape())
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{key}' ({exc}); re-download the file") from None
        if name not in _DTYPES:
            raise CheckpointError(f"{path}: tensor '{key}' has dtype {name}, which unispec does not load")
        return _DTYPES[name], shape

    def is_fp8_quantized(self, stored: torch.dtype) -> bool:
        return self.fp8_block is not None and stored == torch.float8_e4m3fn

    def loaded_dtype(self, stored: torch.dtype) -> torch.dtype:
        """What `__getitem__` returns: dequantized FP8 defaults to float32; ints and bools stay as stored."""
        if self.is_fp8_quantized(stored):
            return self.dtype or torch.float32
        if stored.is_floating_point and self.dtype is not None:
            return self.dtype
        return stored

    def load(self, key: str) -> torch.Tensor:
        if key in self.int4:          # AWQ / GPTQ: dequantized, its codes remembered (export/awq_gptq.py)
            prefix = self.int4[key]
            origin = read_int4(self.read, self.info, prefix, self.int4_format, self.files[prefix + ".qweight"])
            tensor = origin.dequantize()
            return remember_int4(tensor if self.dtype in (None, tensor.dtype) else tensor.to(self.dtype), origin)
        stored, shape = self.info(key)
        target = self.loaded_dtype(stored)
        if stored == target:        # no conversion: a view of the map, read from disk only when used
            path = self.files[key]
            if path not in self.maps:
                self.maps[path] = _Mapped(path)
            return self.maps[path].view(key, stored, shape)
        if not self.is_fp8_quantized(stored):
            tensor = self.read(key)
            return tensor if tensor.dtype == target else tensor.to(target)
        origin = self._fp8_origin(key)
        tensor = dequantize_fp8_blocks(origin.codes, origin.scale_inv, origin.block)
        return remember(tensor if tensor.dtype == target else tensor.to(target), origin)   # export/fp8.py

    def _fp8_origin(self, key: str) -> Fp8Weight:
        """An FP8 weight and its block scales as stored; a missing or misshapen scale names the weight's key."""
        assert self.fp8_block is not None
        scale_key = key + SCALE_SUFFIX
        path = self.files[key]
        if scale_key not in self.files:
            raise CheckpointError(f"{path}: FP8 tensor '{key}' has no '{scale_key}' beside it; the checkpoint "
                                  "is incomplete or not block-FP8 (check quantization_config in config.json)")
        _, shape = self.info(key)
        _, scale_shape = self.info(scale_key)
        want = tuple(math.ceil(n / b) for n, b in zip(shape, self.fp8_block))
        if len(shape) != 2 or scale_shape != want:
            raise CheckpointError(f"{path}: FP8 tensor '{key}' {list(shape)} needs a 2-D weight and "
                                  f"'{scale_key}' of shape {list(want)} for block {list(self.fp8_block)}, "
                                  f"got {list(scale_shape)}; check weight_block_size in config.json")
        return Fp8Weight(key, path, self.read(key), self.read(scale_key), self.fp8_block)


class Checkpoint(Mapping[str, torch.Tensor]):
    """A lazy `Mapping[str, Tensor]` over a checkpoint directory (or a prefix view of one).

    Use `Checkpoint.open(dir, dtype=...)`; `with_prefix("model.layers.61.")` gives the same kind of
    object over the keys under that prefix, with the prefix stripped.
    """

    def __init__(self, store: _Store, config: dict[str, Any], prefix: str = "") -> None:
        self._store = store
        self.config = config
        self.prefix = prefix
        self._keys = tuple(k[len(prefix):] for k in store.keys if k.startswith(prefix))
        self._key_set = frozenset(self._keys)

    @classmethod
    def open(cls, path: str | Path, *, dtype: torch.dtype | None = None) -> Checkpoint:
        """Read config.json and the weight file headers/index; no tensor data is read here.

        `path` is a checkpoint directory or a hub id `org/name[@revision]` found in (or, online, fetched
        into) the Hugging Face cache; a directory of the same spelling wins (export/hub.py).
        """
        root = resolve_checkpoint(path)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CheckpointError(f"{root}: dtype must be a floating torch dtype (or None), got {dtype!r}")
        config = read_config_json(root)
        return cls(_Store(root, dtype, _fp8_block(config), int4_format(config)), config)

    @property
    def path(self) -> Path:
        return self._store.root

    def with_prefix(self, prefix: str) -> Checkpoint:
        """A view of the keys starting with `prefix`, stripped of it; shares open files with this one."""
        return Checkpoint(self._store, self.config, self.prefix + prefix)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._store.load(self._full(key))

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape from the file header, without reading the data."""
        return self._store.info(self._full(key))[1]

    def dtype_of(self, key: str) -> torch.dtype:
        """The dtype `self[key]` will have (after casting or FP8 dequantization), from the header alone."""
        return self._store.loaded_dtype(self._store.info(self._full(key))[0])

    def _full(self, key: str) -> str:
        if key not in self._key_set:
            raise self._store.missing(self.prefix + key)  # names the full key and the files searched
        return self.prefix + key

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        view = f", prefix={self.prefix!r}" if self.prefix else ""
        return f"Checkpoint({str(self.path)!r}, {len(self)} tensors{view})"

    # Mapping's __eq__ would read every tensor and then fail on tensor truthiness: compare by identity.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def close(self) -> None:
        """Drop the open files (and their memory maps); later reads reopen them. A map stays alive while
        a tensor viewing it does."""
        self._store.handles.clear()
        self._store.maps.clear()
