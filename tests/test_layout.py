"""The layout rules of DESIGN.md §2, read off the source with `ast`: no import cycle between files, imports
only point down the floors, and no module (nor a native .cc or .h under plugins/) grows past ~400 lines.

Floors: unispec -> export, engines, runtime -> plugins. `export` and `engines` may use only runtime's leaf
modules (manifest, errors, noise); `runtime` never imports `export` or `engines`; `plugins` imports nothing
else of ours. Every import counts, module-level and function-level alike: a lazy import still ties two
files together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("unispec", "export", "engines", "runtime", "plugins")
RUNTIME_LEAVES = {"runtime", "runtime.manifest", "runtime.errors", "runtime.noise", "runtime.pool_layout"}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules `path` imports: `from a.b import c` names a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names}
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_no_import_cycle_between_files() -> None:
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_imports_point_down_the_floors() -> None:
    packages = {"unispec": set(PACKAGES), "export": {"export", "plugins"}, "engines": {"engines", "plugins"},
                "runtime": {"runtime", "plugins"}, "plugins": {"plugins"}}
    wrong = [f"{module} imports {name}" for module, imported in _graph().items() for name in imported
             if name.split(".")[0] not in packages[module.split(".")[0]]
             and not (module.split(".")[0] in ("export", "engines") and name in RUNTIME_LEAVES)]
    assert not wrong, wrong


def _sources() -> dict[str, Path]:
    """Every file the size rule counts: our Python modules and the native kernels' C++ under plugins/."""
    native = {str(p.relative_to(ROOT)): p for ext in ("cc", "h") for p in (ROOT / "plugins").rglob(f"*.{ext}")}
    return {**_modules(), **native}


def test_no_module_over_400_lines() -> None:
    long = {name: n for name, path in _sources().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_size_rule_counts_the_native_sources() -> None:
    assert {"plugins/ort_cpu/kernel.h", "plugins/ort_cpu/register.cc"} <= set(_sources())


def test_the_checker_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


MAX_DOCSTRING_LINES = 40      # a module docstring keeps the rule and one line of why; history goes to docs/notes


def test_no_module_docstring_over_40_lines() -> None:
    files = {**_modules(), **{str(p.relative_to(ROOT)): p for p in (ROOT / "benchmarks").glob("*.py")}}
    long = {name: n for name, path in files.items()
            if (doc := ast.get_docstring(ast.parse(path.read_text()), clean=False))
            and (n := doc.count("\n") + 1) > MAX_DOCSTRING_LINES}
    assert not long, long
