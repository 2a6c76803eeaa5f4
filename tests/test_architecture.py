"""The shape of the code, checked: one-way imports, no cycles, no borrowed private names, the
folder rules, small files, one decode loop (docs/architecture.md).

The layers, from the top: cli -> serve / bench / trace / training -> chat / eval ->
generation -> runtime -> book -> models -> attention -> util, with the package's vocabulary
(`qkv.errors`, `qkv.names`) under all of them. These tests read the sources with `ast`
(nothing is imported) and count every import, at module level and inside functions: a lazy
import keeps start-up cheap, but it must point down like any other, so it never closes a
cycle. A new arrow the wrong way fails here with the file and the import that adds it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "qkv"
TESTS = Path(__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every absolute qkv import of a file, anywhere in it: (module it names, names it takes).
    `from qkv.models import loader` names the module qkv.models.loader."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names if alias.name.split(".")[0] == "qkv")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "qkv":
            names = [alias.name for alias in node.names]
            modules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            found.extend((m, []) for m in modules)
            rest = [n for n in names if f"{node.module}.{n}" not in MODULES]
            if rest:
                found.append((node.module, rest))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}


def test_no_import_cycles_counting_every_import() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert cycles == []


def test_no_module_takes_another_modules_private_names() -> None:
    taken = [f"{path.relative_to(SRC)} takes {module}.{name}"
             for importer, path in MODULES.items() for module, names in _imports(path) if module != importer
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert taken == []


# Each layer may import only from the layers below it (and the vocabulary: qkv.errors, qkv.names).
LAYERS = ["util", "attention", "models", "book", "runtime", "generation", ("chat", "eval"),
          ("trace", "training", "bench", "serve"), "cli"]
# Inside a layer, the same rule between its folders (lowest first).
INNER_LAYERS = {
    "qkv.trace": ["record", "explain", "render"],
    "qkv.serve": ["errors", "engine", "api", "explorer", "http"],
    "qkv.models": [("configs",), ("decoder", "spec_decoder", "gpt2", "llama", "bert"), "key_maps", "registry", "hf",
                   "gguf", ("book_pth", "context_parallel"), "loader", "tensor_parallel"],
    "qkv.bench": ["measure", "gpt2_checkpoint", "common", "sections", "runner"],
    "qkv.training": [("book",), ("loop",)],
}


def _rank(layers: list, name: str) -> int | None:
    for rank, layer in enumerate(layers):
        if name in ((layer,) if isinstance(layer, str) else layer):
            return rank
    return None


def _wrong_way(layers: list, prefix: str) -> list[str]:
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith(prefix + "."):
            continue
        own = _rank(layers, module[len(prefix) + 1:].split(".")[0])
        for target, _ in _imports(path):
            if not target.startswith(prefix + "."):
                continue
            theirs = _rank(layers, target[len(prefix) + 1:].split(".")[0])
            if own is not None and theirs is not None and theirs > own:
                wrong.append(f"{path.relative_to(SRC)} imports {target}")
    return wrong


def test_imports_point_one_way_between_layers() -> None:
    assert _wrong_way(LAYERS, "qkv") == []


def test_imports_point_one_way_inside_layers() -> None:
    assert [line for prefix, layers in INNER_LAYERS.items() for line in _wrong_way(layers, prefix)] == []


def test_every_folder_has_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert sorted(f for f in folders if _rank(LAYERS, f) is None) == []


def test_the_package_root_holds_only_its_vocabulary() -> None:
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "errors.py", "names.py"]


def test_no_folder_is_a_pile() -> None:
    """A folder of more than 15 files is split into sub-folders that say what they hold."""
    piles = {}
    for root in (PACKAGE, TESTS):
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            files = [p for p in folder.iterdir() if p.is_file() and p.suffix in (".py", ".cpp", ".h")]
            if len(files) > 15:
                piles[str(folder.relative_to(root.parent))] = len(files)
    assert piles == {}


def test_tests_mirror_the_package() -> None:
    """Every test folder is a folder of src/qkv (or one of the suites that span it)."""
    spanning = {"examples", "hostile", "training/book_reference"}
    stray = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"
             and not (PACKAGE / p.relative_to(TESTS)).is_dir()
             and not any(str(p.relative_to(TESTS)).startswith(s) for s in spanning)]
    assert stray == []


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
    # A follower rank of a tensor-parallel server replays the steps rank 0's decode loop shares with it.
    assert sorted(set(steppers)) == ["generation/decode_loop.py", "runtime/tensor_parallel_steps.py"]


def test_one_linear_interface() -> None:
    """Each linear kind the runtime makes says what qkv's whole-layer kernel reads of it
    (`kernel_tensors`, qkv.runtime.linear.kernel); the layer step knows no linear kinds."""
    silent = []
    for path in (PACKAGE / "runtime" / "linear").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Linear"):
                methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
                if "forward" in methods and "kernel_tensors" not in methods:
                    silent.append(f"{path.name}: {node.name}")
    assert silent == []
    step = [target for target, _ in _imports(PACKAGE / "runtime" / "layer_step.py")
            if target.startswith("qkv.runtime.linear")]
    assert step == ["qkv.runtime.linear.kernel"]


def test_one_block_format_table() -> None:
    """GGUF's block layouts are written once per language: in C++ one struct per block type and
    one traits table (runtime/native/csrc/block_format.h, .cpp), in Python the formats of
    qkv.models.gguf.dequantize (sizes from the gguf package); IQ4_NL's code book once in each,
    and the block sizes' magic numbers nowhere else in the C++."""
    csrc = PACKAGE / "runtime" / "native" / "csrc"
    sources = {path.name: path.read_text() for path in csrc.iterdir() if path.suffix in (".h", ".cpp")}
    book = "-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113"
    assert [name for name, text in sources.items() if book in text] == ["block_format.h"]
    python = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if book in path.read_text()]
    assert python == ["models/gguf/kquants.py"]
    assert [name for name, text in sources.items() if "struct BlockQ4_K" in text] == ["block_format.h"]
    assert [name for name, text in sources.items() if "enum Variant" in text] == ["kernels.h"]
    detections = [name for name, text in sources.items() if "__builtin_cpu_supports(\"" in text]
    assert detections == ["products.cpp"], "one CPU detection (kernels.h's best_variant)"
