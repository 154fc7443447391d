"""The product's import structure: no import circle and no import from a lower layer up.

Every product .py file (the checkout's, tests/ aside) is parsed with `ast`, and every import in it, at
module level or inside a function, is an edge to the project module it names (`from pkg import name`
names pkg/name.py when that exists, else pkg/__init__.py; scripts/ run with scripts/ on sys.path, so
`from bench import cli` there names scripts/bench/cli.py).  A *unit* is a top-level module or
package: model, kernels, cache, checkpoint (a module or a package alike), ...

Layers, lowest first.  A unit may import from units of a lower layer and of its own layer, never
from a higher one; layer 0 units are leaves and import nothing from the project:

    0  model.py, atomic_io.py               the model (copyable alone: torch only); all-or-nothing writes
    1  kernels/                             ops: attention over caches, KIVI's codec, int4/int8 GEMV,
                                            the C++ CPU kernels (kernels/cpu.py plugs into model.py's layers)
    2  cache/                               the KV-cache policies and their storage
    3  checkpoint, quantize.py,             reading / writing / quantizing / sharding checkpoints,
       tokenizer/, tp.py                    the tokenizer (tp.py reads cache/shard.py)
    4  runtime/                             the steps, sampling, RowBatch, the context protocol, kept prefixes
    5  engine.py                            loading, generate, the CLI
    6  eval/, server/, serve.py             programs on the engine: the evals, the server (serve.py its command)
    7  scripts/                             benchmarks, peers, tools

Circles are looked for twice: between modules (a package's __init__ counts as one module, so a
submodule importing the __init__ that imports it is a circle) and between units.  A new top-level
unit fails the test until it gets a layer here (and in docs/design.md, "Layers").
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [("model", "atomic_io"), ("kernels",), ("cache",), ("checkpoint", "quantize", "tokenizer", "tp"),
          ("runtime",), ("engine",), ("eval", "server", "serve"), ("scripts",)]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
NOT_PRODUCT = {"tests", "checkpoints", "runs", "build", "downloaded", "data", "docs"}


def product_files(root: Path) -> list[Path]:
    """The .py files git tracks or would track (untracked, not ignored) under root, tests/ aside."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
                             cwd=root, capture_output=True, check=True).stdout.decode()
        paths = [root / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in root.rglob("*.py") if not {".git", ".venv", "__pycache__"} & set(p.parts)]
    return sorted(p for p in paths if p.exists() and p.relative_to(root).parts[0] not in NOT_PRODUCT)


def module_names(root: Path, files: list[Path]) -> dict[str, Path]:
    """Dotted module name -> file; a package's name -> its __init__.py."""
    names = {}
    for f in files:
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = f
    return names


def resolve(name: str, modules: dict, top: str) -> str | None:
    """The project module an imported dotted name lands in (its longest known prefix), or None (not
    the project's).  Names are tried from the root, then, in a top folder that is not a package
    (scripts/: its programs put it on sys.path), from that folder."""
    for full in (name, f"{top}.{name}") if top not in modules else (name,):
        while full and full not in modules:
            full = full.rpartition(".")[0]
        if full:
            return full
    return None


def import_edges(root: Path, files: list[Path]) -> list[tuple[str, str, str]]:
    """(importing module, imported project module, 'file:line') for every import statement."""
    modules = module_names(root, files)
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        top = name.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if base else a.name for a in node.names]
            else:
                continue
            for t in targets:
                dst = resolve(t, modules, top)
                edge = (name, dst, f"{path.relative_to(root)}:{node.lineno}")
                if dst is not None and dst != name and edge not in edges:
                    edges.append(edge)
    return edges


def unit(module: str) -> str:
    return module.split(".")[0]


def circles(edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), members sorted."""
    graph: dict[str, set] = {}
    for a, b, *_ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_violations(edges) -> list[str]:
    """Imports of a unit from a higher layer (or, from layer 0, any project import); undeclared units."""
    bad = []
    for a, b, where in edges:
        ua, ub = unit(a), unit(b)
        if ua == ub:
            continue
        for u in (ua, ub):
            if u not in LAYER:
                bad.append(f"{where}: unit {u!r} has no layer (declare it in tests/test_layers.py LAYERS)")
        if ua in LAYER and ub in LAYER and (LAYER[ub] > LAYER[ua] or LAYER[ua] == 0):
            bad.append(f"{where}: {a} (layer {LAYER[ua]}) imports {b} (layer {LAYER[ub]})")
    return bad


@pytest.fixture(scope="module")
def edges():
    files = product_files(ROOT)
    assert len(files) > 50
    return import_edges(ROOT, files)


def test_every_product_file_parses_and_the_graph_is_drawn(edges):
    pairs = {(a, b) for a, b, _ in edges}
    assert ("cache.quantized", "kernels.kivi_attention") in pairs       # a module-level import
    assert ("scripts.benchmark", "scripts.bench.cli") in pairs          # scripts/ on sys.path
    assert ("kernels.kivi_attention", "kernels.kivi_triton") in pairs  # an import inside a function


def test_no_import_circle_between_modules(edges):
    assert circles(edges) == []


def test_no_import_circle_between_units(edges):
    assert circles([(unit(a), unit(b)) for a, b, _ in edges if unit(a) != unit(b)]) == []


def test_no_upward_import(edges):
    assert layer_violations(edges) == []


# --------------------------------------------------------------------------- the checker on made-up trees

def write_tree(root: Path, files: dict) -> list[Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return sorted(root / name for name in files)


def test_the_checker_catches_a_function_level_circle_and_an_upward_import(tmp_path):
    files = write_tree(tmp_path, {
        "model.py": "import torch\n",
        "kernels/__init__.py": "from .ops import f\n",
        "kernels/ops.py": "def f():\n    from kernels import g\n",            # circle through the __init__
        "cache/__init__.py": "",
        "cache/a.py": "from cache.b import x\nimport model\nimport kernels.ops\n",
        "cache/b.py": "def x():\n    import cache.a\n",                     # circle, function level
        "kernels/up.py": "def h():\n    from cache.a import x\n",           # kernels -> cache: upward
        "engine.py": "import cache.a\nfrom kernels import up\n",
        "scripts/s.py": "from bench import run\n", "scripts/bench/__init__.py": "",
        "scripts/bench/run.py": "import engine\n",
    })
    edges = import_edges(tmp_path, files)
    assert circles(edges) == [["cache.a", "cache.b"], ["kernels", "kernels.ops"]]
    assert circles([(unit(a), unit(b)) for a, b, _ in edges if unit(a) != unit(b)]) == [["cache", "kernels"]]
    assert layer_violations(edges) == ["kernels/up.py:2: kernels.up (layer 1) imports cache.a (layer 2)"]
    assert ("scripts.s", "scripts.bench.run", "scripts/s.py:1") in edges


def test_the_checker_wants_a_layer_for_a_new_unit_and_leaves_for_layer_0(tmp_path):
    files = write_tree(tmp_path, {"model.py": "import atomic_io\n", "atomic_io.py": "",
                                  "webapp.py": "import model\n"})
    assert layer_violations(import_edges(tmp_path, files)) == [
        "model.py:1: model (layer 0) imports atomic_io (layer 0)",
        "webapp.py:1: unit 'webapp' has no layer (declare it in tests/test_layers.py LAYERS)"]
