"""Imports run one way: no import cycle inside the jaxinfer package, and every module imports alone.

The import graph is read from the package source with the standard library's `ast`, not from
pydeps or import-linter. pydeps draws graphs (through graphviz) and import-linter checks declared
contracts (layers, independence, forbidden imports) over grimp's graph; both are extra
dependencies, and neither tells an import at the top of a module from one inside a function, a
difference this test reports. The property checked here, no cycle at all, needs only the graph,
and `ast` builds it in a few dozen lines with the file and line of every edge to print.

An edge A -> B means module A imports module B:
  `import jaxinfer.x.y`, `from jaxinfer.x import y` (y a module), `from .y import z`  -> the module y;
  `from jaxinfer.x import name` (name not a module: a function or class)             -> jaxinfer.x.
Parent packages are not edges: `from jaxinfer.x.y import z` also runs jaxinfer/x/__init__.py, but
an `__init__` that re-exports its modules would otherwise close a cycle through every module of
its folder. grimp, import-linter's graph, draws the same edges. Imports under
`if TYPE_CHECKING:` never run and are left out: an annotation that names the class of an object
handed in (a Request's engine) is not an import the program makes.

Two kinds of edge:
  module-level  runs when A is imported (also inside a class body, `try` or `if` at top level);
  lazy          inside a function: runs when the function is first called.
A cycle through a lazy import is still a cycle: two modules that need each other are one
module split in two, and the lazy import only hides it from Python's import order. So both
tests fail on any cycle; the first names the module-level ones, the second those that close
only through a lazy import.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "jaxinfer"


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, e.g. "jaxinfer.text.spm"
    dst: str  # imported module
    where: str  # "jaxinfer/text/spm.py:12"
    lazy: bool  # inside a function body


def package_modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """Every module of the package: {dotted name: file path}; a package is its `__init__.py`."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                out[name] = os.path.join(folder, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, lazy) for every import statement that can run, skipping `if TYPE_CHECKING:` bodies."""
    stack = [(tree, False)]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((c, inner) for c in children)


def _base(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved against `name`)."""
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_edges(modules: dict[str, str] | None = None) -> list[Edge]:
    """Edges between modules of the package, each with where it is written and whether it is lazy."""
    modules = package_modules() if modules is None else modules
    edges = []
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        for node, lazy in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _base(name, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
            edges += [Edge(name, t, where, lazy) for t in dict.fromkeys(targets) if t in modules and t != name]
    return edges


def strongly_connected(nodes, edges: list[Edge]) -> list[list[str]]:
    """Groups of modules that reach each other through `edges` (Tarjan), only groups of 2 or more."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.src].append(e.dst)
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        group.append(x)
                        if x == v:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(succ[w])))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return sorted(groups)


def describe(groups: list[list[str]], edges: list[Edge]) -> str:
    """Each group of mutually importing modules with the edges inside it, file:line and kind."""
    lines = []
    for g in groups:
        members = set(g)
        lines.append(f"cycle among {len(g)} modules: {', '.join(g)}")
        for e in sorted(edges, key=lambda e: (e.src, e.dst, e.where)):
            if e.src in members and e.dst in members:
                lines.append(f"    {e.src} -> {e.dst}  ({e.where}{', lazy' if e.lazy else ''})")
    return "\n".join(lines)


def test_graph_reader_sees_every_kind_of_import(tmp_path):
    """The reader on a made-up package: absolute, relative, lazy, re-exported and TYPE_CHECKING."""
    pkg = tmp_path / "jaxinfer"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from jaxinfer.sub.a import f\n",
        "sub/__init__.py": "from . import a\n",
        "sub/a.py": "import jaxinfer.sub.b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxinfer import c\n",
        "sub/b.py": "def g():\n    from ..c import h\n    from jaxinfer import sub\n",
        "c.py": "from jaxinfer.sub import b, a\nclass K:\n    from . import sub as s\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    mods = package_modules(str(tmp_path))
    assert sorted(mods) == ["jaxinfer", "jaxinfer.c", "jaxinfer.sub", "jaxinfer.sub.a", "jaxinfer.sub.b"]
    got = {(e.src, e.dst, e.lazy) for e in import_edges(mods)}
    assert got == {("jaxinfer", "jaxinfer.sub.a", False), ("jaxinfer.sub", "jaxinfer.sub.a", False),
                   ("jaxinfer.sub.a", "jaxinfer.sub.b", False), ("jaxinfer.sub.b", "jaxinfer.c", True),
                   ("jaxinfer.sub.b", "jaxinfer.sub", True), ("jaxinfer.c", "jaxinfer.sub.b", False),
                   ("jaxinfer.c", "jaxinfer.sub.a", False), ("jaxinfer.c", "jaxinfer.sub", False)}
    edges = import_edges(mods)
    assert strongly_connected(mods, [e for e in edges if not e.lazy]) == []
    assert strongly_connected(mods, edges) == [["jaxinfer.c", "jaxinfer.sub", "jaxinfer.sub.a", "jaxinfer.sub.b"]]


def test_no_module_level_import_cycles():
    edges = [e for e in import_edges() if not e.lazy]
    groups = strongly_connected(package_modules(), edges)
    assert not groups, "module-level import cycles:\n" + describe(groups, edges)


def test_no_import_cycles_through_lazy_imports():
    """Cycles that close only through an import inside a function (module-level ones excluded)."""
    modules, edges = package_modules(), import_edges()
    eager = {frozenset(g) for g in strongly_connected(modules, [e for e in edges if not e.lazy])}
    groups = [g for g in strongly_connected(modules, edges) if frozenset(g) not in eager]
    assert not groups, "import cycles through lazy (function-level) imports:\n" + describe(groups, edges)


# One interpreter imports each module with no jaxinfer module loaded before it. A fresh interpreter per
# module would also unload jax, numpy and the other dependencies, but each start re-imports jax (~2 s on a
# 2-core machine, ~45 modules: over a minute); what can break between our modules is their order among
# themselves, and that is what clearing every `jaxinfer*` entry of sys.modules starts afresh.
# Importing `a.b.c` afresh imports `a`, then `a.b`, then `a.b.c`, each only if not loaded yet. So when
# the fresh import of an ancestor package (`a`, or `a.b`) already loaded `a.b.c`, importing `a.b.c`
# afresh runs exactly the same module bodies in the same order, and that import has already succeeded:
# the names are sorted (a package before its modules), and such a module is counted as imported alone
# without clearing and importing everything again (`import jaxinfer` loads most of the package).
_IMPORT_EACH = textwrap.dedent("""
    import importlib, sys, traceback
    failed, loaded_by, fresh = [], {}, 0
    for name in sys.argv[1:]:
        parts = name.split(".")
        if any(name in loaded_by.get(".".join(parts[:i]), ()) for i in range(1, len(parts))):
            continue  # an ancestor's fresh import loaded it: the same import, already done
        for m in [m for m in sys.modules if m == "jaxinfer" or m.startswith("jaxinfer.")]:
            del sys.modules[m]
        argv, sys.argv = sys.argv, ["jaxinfer", "--help"]  # jaxinfer.__main__ runs the CLI: ask for help
        fresh += 1
        try:
            importlib.import_module(name)
            loaded_by[name] = {m for m in sys.modules if m == "jaxinfer" or m.startswith("jaxinfer.")}
        except SystemExit as e:
            if name != "jaxinfer.__main__" or e.code not in (0, None):
                failed.append(f"{name}: SystemExit({e.code})")
        except BaseException:
            failed.append(f"{name}:\\n{traceback.format_exc(limit=-3)}")
        finally:
            sys.argv = argv
    print("\\n".join(failed) or f"all {len(sys.argv) - 1} imported ({fresh} fresh imports)", file=sys.stderr)
    sys.exit(1 if failed else 0)
""")


def test_every_module_imports_alone():
    names = sorted(package_modules())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"modules that fail to import alone:\n{p.stderr[-5000:]}"
    assert f"all {len(names)} imported" in p.stderr, p.stderr[-5000:]


# The serving Engine's parts in layers: a part imports parts of earlier layers only, and none
# imports engine.py, their one client (serve's other modules, such as runner, live and
# scheduler, are below all of them).
ENGINE_PARTS = [("jaxinfer.serve.held", "jaxinfer.serve.sizing"),
                ("jaxinfer.serve.admission", "jaxinfer.serve.flights"),
                ("jaxinfer.serve.recovery", "jaxinfer.serve.background"),
                ("jaxinfer.serve.updates",),
                ("jaxinfer.serve.engine",)]


def test_engine_parts_import_one_way():
    """serve/engine.py is the public face of parts with one job each (ARCHITECTURE.md's serve/):
    no part reaches back into the Engine or into a part of its own or a later layer."""
    modules = package_modules()
    layer = {m: i for i, names in enumerate(ENGINE_PARTS) for m in names}
    assert set(layer) <= set(modules), sorted(set(layer) - set(modules))
    backwards = [e for e in import_edges(modules)
                 if e.src in layer and e.dst in layer and layer[e.dst] >= layer[e.src]]
    assert not backwards, "imports against the engine's layers:\n" + "\n".join(
        f"    {e.src} -> {e.dst}  ({e.where}{', lazy' if e.lazy else ''})" for e in backwards)
