"""Engine build recipes: small TOML files that say how to build, never what the model is.

A recipe holds the TensorRT builder settings and the optimization-profile preferences; everything about
the model (dtypes, shapes, bounds) comes from the artifact's manifest. Recipes are portable across
artifacts: opt values are clamped into each artifact's own ranges (engines/tensorrt/profiles.py).

    # engines/tensorrt/recipes/decode-heavy.toml
    description = "kernels tuned for full batches of one new token per row"
    opt_tokens_per_row = 1

There are no precision fields: TensorRT 11 and TensorRT-RTX networks are strongly typed, so every tensor's
type is the ONNX graph's (export with --dtype to change it); FP16/BF16 builder flags no longer exist.
`compute_capabilities` (["sm_86", "sm_89"]) picks TensorRT-RTX's target GPUs; TensorRT 11 ignores it (it
builds for the GPU it runs on). `tactic_sources` is checked against the flavour that builds.
Built-in recipes live in engines/tensorrt/recipes/ and are named by their file stem (`--recipe decode-heavy`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from engines.tensorrt.flavours import RTX_COMPUTE_CAPABILITIES, parse_compute_capability
from runtime.errors import ConfigError

__all__ = ["BUILTIN_DIR", "DEFAULT_RECIPE", "TACTIC_SOURCES", "Recipe", "builtin_recipes", "load_recipe",
           "parse_recipe"]

BUILTIN_DIR = "recipes"
DEFAULT_RECIPE = "default"
# TacticSource names a recipe may list (TensorRT 11 has all; TensorRT-RTX only the last two: a build checks
# them against its flavour, engines/tensorrt/flavours.py)
TACTIC_SOURCES = ("CUBLAS", "CUBLAS_LT", "CUDNN", "EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Build settings. `None` means "derive from the artifact" (profiles) or "TensorRT's default" (builder)."""

    name: str = DEFAULT_RECIPE
    description: str = ""
    builder_optimization_level: int = 3          # 0..5: higher searches more tactics, builds slower
    max_workspace_bytes: int | None = None       # WORKSPACE memory pool limit
    tactic_sources: tuple[str, ...] | None = None
    compute_capabilities: tuple[str, ...] | None = None   # TensorRT-RTX targets ("sm_86"); None: the GPU
                                                          # present, else engines.tensorrt.flavours.RTX_DEFAULT_TARGETS
    num_blocks: int | None = None                # largest KV pool the engine accepts (default: a full batch
    kv_memory_bytes: int | None = None           # of max_model_len rows), optionally capped by this budget
    opt_batch: int | None = None                 # profile opt: rows per step (default: max_batch_size)
    opt_tokens: int | None = None                # new tokens per step (default: max_tokens_per_step)
    opt_tokens_per_row: int | None = None        # ... or opt_batch * this (1 = decode); excludes opt_tokens
    opt_context_len: int | None = None           # cached tokens per row -> opt max_blocks (default: max)
    cuda_graph_batches: tuple[int, ...] = ()     # TRT backend: decode steps padded to these batch sizes
    require_plugins: bool = False                # fail when a custom op would build from its ONNX function

    def __post_init__(self) -> None:
        where = f"recipe {self.name!r}"
        if not 0 <= self.builder_optimization_level <= 5:
            raise ConfigError(f"{where}: builder_optimization_level must be in 0..5, got "
                              f"{self.builder_optimization_level}")
        for key in ("max_workspace_bytes", "num_blocks", "kv_memory_bytes", "opt_batch", "opt_tokens",
                    "opt_tokens_per_row", "opt_context_len"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{where}: {key} must be >= 1 (or left out), got {value}")
        if self.opt_tokens is not None and self.opt_tokens_per_row is not None:
            raise ConfigError(f"{where}: give opt_tokens or opt_tokens_per_row, not both")
        unknown = sorted(set(self.tactic_sources or ()) - set(TACTIC_SOURCES))
        if unknown:
            raise ConfigError(f"{where}: unknown tactic_sources {unknown}; use names from {list(TACTIC_SOURCES)}")
        if self.compute_capabilities is not None:
            try:
                targets = tuple(parse_compute_capability(cc) for cc in self.compute_capabilities)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            outside = [cc for cc in targets if cc not in RTX_COMPUTE_CAPABILITIES]
            if not targets or outside:
                raise ConfigError(f"{where}: compute_capabilities {list(self.compute_capabilities)} must name "
                                  f"TensorRT-RTX targets from {list(RTX_COMPUTE_CAPABILITIES)}")
            object.__setattr__(self, "compute_capabilities", targets)      # normalized: "8.6" -> "sm_86"
        if any(b < 1 for b in self.cuda_graph_batches) or list(self.cuda_graph_batches) != sorted(
                set(self.cuda_graph_batches)):
            raise ConfigError(f"{where}: cuda_graph_batches must be increasing batch sizes >= 1, got "
                              f"{list(self.cuda_graph_batches)}")


def _field_kinds() -> dict[str, tuple[type, bool]]:
    """field -> (element type, is a list), read off Recipe's annotations (the schema is the dataclass)."""
    kinds = {}
    for name, hint in typing.get_type_hints(Recipe).items():
        if typing.get_origin(hint) in (typing.Union, types.UnionType):      # X | None
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        is_list = typing.get_origin(hint) is tuple
        kinds[name] = (typing.get_args(hint)[0] if is_list else hint, is_list)
    return kinds


def _check_value(key: str, value: Any, where: str) -> Any:
    base, is_list = _field_kinds()[key]
    items = value if is_list and isinstance(value, list) else [value]
    # bool is an int in Python: a TOML `true` must not pass as a count
    ok = (not is_list or isinstance(value, list)) and all(
        isinstance(v, base) and (base is bool or not isinstance(v, bool)) for v in items)
    if not ok:
        kind = f"a list of {base.__name__}" if is_list else base.__name__
        raise ConfigError(f"{where}: {key} must be {kind}, got {value!r}")
    return tuple(value) if is_list else value


def parse_recipe(data: dict[str, Any], *, name: str, where: str | None = None) -> Recipe:
    """A parsed TOML table -> Recipe; unknown keys and wrongly typed values fail in one line."""
    where = where or f"recipe {name!r}"
    known = {f.name for f in dataclasses.fields(Recipe)}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
        if isinstance(value, dict):
            raise ConfigError(f"{where}: {key} is a table; recipes are flat key = value files")
    values = {key: _check_value(key, value, where) for key, value in data.items()}
    values.setdefault("name", name)
    try:
        return Recipe(**values)
    except ConfigError as exc:          # say which file, not only which recipe name
        raise ConfigError(str(exc).replace(f"recipe {values['name']!r}", where, 1)) from None


def builtin_recipes() -> dict[str, Path]:
    """Built-in recipe name -> file (engines/tensorrt/recipes/*.toml)."""
    folder = resources.files("engines.tensorrt") / BUILTIN_DIR
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".toml")}


def load_recipe(recipe: str | Path | None = None) -> Recipe:
    """A recipe file path, a built-in name (`decode-heavy`), or None for the default recipe."""
    builtin = builtin_recipes()
    if recipe is None:
        recipe = DEFAULT_RECIPE
    path = Path(recipe)
    if not path.is_file():
        if str(recipe) not in builtin:
            raise ConfigError(f"recipe {str(recipe)!r}: no such file and no built-in recipe of that name; "
                              f"built-in recipes: {', '.join(sorted(builtin))}")
        path = builtin[str(recipe)]
    return parse_recipe(_read_toml(path), name=path.stem, where=f"recipe {path}")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10: the same parser as the tomli package
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {path}: not valid TOML ({exc}); fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe {path}: cannot be read ({exc})") from None
