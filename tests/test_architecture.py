"""The shape of the code, checked: one-way imports, no cycles, small files, one decode loop.

The arrows point one way (README, "How the code is laid out"): cli -> serve / bench / trace /
training -> generation -> runtime -> perf / native -> models -> attention. These tests read
the sources with `ast` (nothing is imported), so a new arrow the wrong way fails here with
the file and the import that adds it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "qkv"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, *, module_level: bool) -> set[str]:
    """Absolute qkv imports of a file: at module level only (what runs on import), or all."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "qkv" or name.startswith("qkv.")}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {m: {t for t in _imports(p, module_level=True) if t in modules and t != m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert cycles == []


# Each package may import only from the packages below it (and top-level helpers).
ABOVE = {
    "qkv.attention": ("models", "runtime", "perf", "native", "generation", "trace", "training", "serve", "bench",
                      "cli", "chat"),
    "qkv.models": ("runtime", "perf", "native", "generation", "trace", "training", "serve", "bench", "cli", "chat"),
    "qkv.runtime.native": ("runtime", "perf", "generation", "trace", "training", "serve", "bench", "cli", "chat"),
    "qkv.runtime.linear": ("runtime", "generation", "trace", "training", "serve", "bench", "cli", "chat"),
    "qkv.runtime": ("generation", "trace", "training", "serve", "bench", "cli", "chat"),
    "qkv.generation": ("trace", "training", "serve", "bench", "cli", "chat"),
}


def test_imports_point_one_way() -> None:
    wrong = []
    for module, path in _modules().items():
        for package, above in ABOVE.items():
            if module == package or module.startswith(package + "."):
                for name in _imports(path, module_level=False):
                    if any(name == f"qkv.{a}" or name.startswith(f"qkv.{a}.") for a in above):
                        wrong.append(f"{path.relative_to(SRC)} imports {name}")
    assert wrong == []


def test_no_source_file_is_over_500_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_one_decode_loop() -> None:
    """Only the decode loop steps a session: every other caller runs DecodeLoop."""
    steppers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "decode"
                    and "session" in ast.unparse(node.func.value).lower()):
                steppers.append(str(path.relative_to(PACKAGE)))
    assert sorted(set(steppers)) == ["generation/decode_loop.py"]
