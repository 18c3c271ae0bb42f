"""A stand-in for `tensorrt` + `tensorrt.plugin` exposing only the QDP surface plugins/<op>/trt.py uses,
so register / autotune / aot_impl run where TensorRT is absent (in a fresh process: `install()` puts the
fakes in sys.modules).

It enforces the signature rules the QDP documentation states (register: TensorDesc inputs first, then
typed attributes, no defaults; autotune: the inputs then `outputs`; aot_impl: the inputs, every attribute
in registration order, `outputs`, `tactic`; extra launch arguments all SymInt32). It models shapes as
ints or symbol names. It says nothing about TensorRT's own behaviour, which only the `trt` tests check.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
import types
from typing import Any

ATTRIBUTE_TYPES = (int, float, bool, str, bytes)


class DataType:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


TYPES = {name: DataType(name) for name in ("FLOAT", "HALF", "BF16", "INT64", "INT32", "INT8", "BOOL")}


class ShapeExpr:
    """A dim: an int (static) or a symbol name (dynamic)."""

    def __init__(self, value: int | str) -> None:
        self.value = value
        self.is_fake = False

    @property
    def is_constant(self) -> bool:
        return isinstance(self.value, int)

    def constant_value(self) -> int:
        assert self.is_constant
        return int(self.value)


class TensorDesc:
    def __init__(self, shape: tuple[int | str, ...], dtype: DataType) -> None:
        self.shape_expr = _Exprs(ShapeExpr(d) for d in shape)
        self.shape = tuple(d if isinstance(d, int) else -1 for d in shape)
        self.dtype = dtype

    def like(self) -> TensorDesc:
        return TensorDesc(self.dims(), self.dtype)

    def dims(self) -> tuple[int | str, ...]:
        return tuple(e.value for e in self.shape_expr)


class _Exprs(list):
    def __setitem__(self, index, value) -> None:  # plugins assign ints or other dims to output dims
        super().__setitem__(index, value if isinstance(value, ShapeExpr) else ShapeExpr(value))


def from_shape_expr(exprs: tuple, dtype: DataType) -> TensorDesc:
    return TensorDesc(tuple(e.value if isinstance(e, ShapeExpr) else e for e in exprs), dtype)


class SymExprs(list):
    pass


class SymInt32:
    def __init__(self, value: Any) -> None:
        self.value = value.value if isinstance(value, ShapeExpr) else value


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, values: list) -> SymIntExprs:
        assert all(isinstance(v, SymInt32) for v in values), "extra launch arguments must be SymInt32"
        return cls(values)


class KernelLaunchParams:
    def __init__(self) -> None:
        self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
        self.shared_mem = 0


class AutoTuneCombination:
    def __init__(self, io_types: str | None = None, layouts: str | None = None, tactics: Any = None) -> None:
        self.io_types = [t.strip() for t in io_types.split(",")] if io_types else []
        self.layouts, self.tactic_list = layouts, list(tactics or [])

    def pos(self, positions: list[int], io_types: str, layouts: str = "LINEAR") -> None:
        for p in positions:
            self.io_types += [None] * (p + 1 - len(self.io_types))
            assert self.io_types[p] is None, f"position {p} given twice"
            self.io_types[p] = io_types

    def tactics(self, tactics: list[int]) -> None:
        self.tactic_list = list(tactics)


PLUGINS: dict[str, dict[str, Any]] = {}


def _schema(fn) -> tuple[list[str], dict[str, type]]:
    """Tensor names and attributes (name -> type) of a register function, checking the QDP rules."""
    tensors, attributes = [], {}
    for name, param in inspect.signature(fn).parameters.items():
        assert param.default is inspect.Parameter.empty, f"{name}: QDP attributes take no defaults"
        if param.annotation is TensorDesc:
            assert not attributes, f"{name}: tensors must come before attributes"
            tensors.append(name)
        else:
            assert param.annotation in ATTRIBUTE_TYPES, f"{name}: unsupported attribute type {param.annotation}"
            attributes[name] = param.annotation
    return tensors, attributes


def register(plugin_id: str):
    def decorate(fn):
        tensors, attributes = _schema(fn)
        PLUGINS[plugin_id] = dict(register=fn, tensors=tensors, attributes=attributes)
        return fn
    return decorate


def _expect(plugin_id: str, fn, tail: list[str], attributes: bool) -> None:
    plugin = PLUGINS[plugin_id]
    names = list(inspect.signature(fn).parameters)
    want = plugin["tensors"] + (list(plugin["attributes"]) if attributes else []) + tail
    assert names == want, f"{plugin_id} {fn.__name__}: parameters {names}, QDP expects {want}"


def autotune(plugin_id: str):
    def decorate(fn):
        _expect(plugin_id, fn, ["outputs"], attributes=False)
        PLUGINS[plugin_id]["autotune"] = fn
        return fn
    return decorate


def aot_impl(plugin_id: str):
    def decorate(fn):
        _expect(plugin_id, fn, ["outputs", "tactic"], attributes=True)
        PLUGINS[plugin_id]["aot_impl"] = fn
        return fn
    return decorate


def install() -> None:
    """Make `import tensorrt` / `import tensorrt.plugin` return the fakes (this process only)."""
    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    for name, dtype in TYPES.items():
        setattr(trt, name, dtype)
    trt.float32, trt.float16, trt.bfloat16, trt.int64, trt.int32, trt.bool = (
        TYPES[n] for n in ("FLOAT", "HALF", "BF16", "INT64", "INT32", "BOOL"))
    plugin = types.ModuleType("tensorrt.plugin")
    for name in ("TensorDesc", "ShapeExpr", "SymExprs", "SymInt32", "SymIntExprs", "KernelLaunchParams",
                 "AutoTuneCombination", "register", "autotune", "aot_impl", "from_shape_expr"):
        setattr(plugin, name, globals()[name])
    trt.plugin = plugin
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, plugin
