"""The import layers of docs/architecture.md hold: every import in zerospeed/ (function-local ones
included) points down the documented order, there is no import cycle, and the product never imports
the test harness.

The order is read from the ```layers``` block in docs/architecture.md, so the picture and the rule
cannot drift apart. Run this file as a script to print the graph's arrows between packages.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zerospeed"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    """Every module of the product: dotted name -> file (the shim's files are another distribution)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "shim" in path.relative_to(PACKAGE).parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(module: str, node: ast.AST, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module if is_package else module.rpartition(".")[0]
    if node.level:
        base = ".".join(base.split(".")[: len(base.split(".")) - (node.level - 1)])
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    # `from a import b` imports module a.b when b is a module, else a name of a
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def imports() -> list[tuple[str, str, bool, int]]:
    """(importer, imported module, function-local?, line) for every import of a zerospeed module."""
    known = modules()
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        local = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if isinstance(n, (ast.Import, ast.ImportFrom))
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, node, path.name == "__init__.py", known):
                if target.split(".")[0] in ("zerospeed", "harness", "zoo"):
                    while target not in known and "." in target:
                        target = target.rpartition(".")[0]
                    found.append((name, target, id(node) in local, node.lineno))
    return sorted(set(found))  # one arrow per import statement and module, however many names it takes


def package_of(module: str, order: dict | None = None) -> str:
    """`zerospeed.zero.stage3.api` -> `zero`; the root package is `zerospeed`. With the layer table,
    a module the table places on its own (`estimate.cli`: an application above its package) is its
    own unit: the longest dotted prefix the table names."""
    parts = module.split(".")
    if parts[0] != "zerospeed" or len(parts) == 1:
        return parts[0]
    for cut in range(len(parts), 2, -1):
        if order is not None and ".".join(parts[1:cut]) in order:
            return ".".join(parts[1:cut])
    return parts[1]


def layers() -> list[list[str]]:
    """The documented order, bottom first: one list of packages per layer."""
    block = re.search(r"```layers\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert block, "docs/architecture.md lost its ```layers block (the order this test enforces)"
    rows = []
    for line in block.group(1).splitlines():
        if ":" in line:
            rows.append(line.split(":", 1)[1].split())
    return rows


def rank() -> dict[str, tuple[int, int]]:
    """package -> (layer, position in its layer): a package may import what ranks below it."""
    return {pkg: (i, j) for i, row in enumerate(layers()) for j, pkg in enumerate(row)}


def arrows_against_order() -> list[str]:
    order = rank()
    bad = []
    for src, dst, local, line in imports():
        a, b = package_of(src, order), package_of(dst, order)
        if a == b or dst.split(".")[0] != "zerospeed":
            continue
        if order[b] >= order[a]:
            bad.append(f"{src}:{line} imports {dst}{' (function-local)' if local else ''}: {b} is not below {a}")
    return bad


def cycles() -> list[list[str]]:
    """The module-level import cycles (strongly connected components of more than one module)."""
    graph = defaultdict(set)
    for src, dst, _, _ in imports():
        if src != dst:
            graph[src].add(dst)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _is_ancestor(src: str, dst: str) -> bool:
    """`dst` is a package containing `src` (its __init__ runs first anyway: not an arrow of its own)."""
    return src.startswith(dst + ".")


def test_every_package_has_a_layer():
    order = rank()
    missing = sorted({package_of(m, order) for m in modules()} - set(order))
    assert not missing, f"packages with no layer in docs/architecture.md's ```layers block: {missing}"


def test_no_import_against_the_layer_order():
    bad = arrows_against_order()
    assert not bad, "imports against the layer order of docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = [c for c in cycles() if not all(_is_ancestor(a, b) or _is_ancestor(b, a) for a in c for b in c if a != b)]
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_product_never_imports_the_harness():
    bad = [f"{src}:{line} imports {dst}" for src, dst, _, line in imports() if dst.split(".")[0] in ("harness", "zoo")]
    assert not bad, "product code imports the test harness or the examples' models:\n" + "\n".join(bad)


def test_function_local_imports_are_only_for_optional_dependencies():
    """zerospeed's own modules are imported at the top of the file: a function-local import of one hides
    an arrow (or a cycle) from whoever reads the imports."""
    bad = [f"{src}:{line} imports {dst} inside a function" for src, dst, local, line in imports() if local]
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    counts = defaultdict(int)
    for src, dst, _local, _ in imports():
        if package_of(src) != package_of(dst):
            counts[(package_of(src), package_of(dst))] += 1
    for (a, b), n in sorted(counts.items()):
        print(f"{a:>14} -> {b:<14} {n}")
    print(
        f"{len(arrows_against_order())} imports against the order; {len(cycles())} cycles; "
        f"{sum(1 for *_, local, _ in imports() if local)} function-local imports of zerospeed modules"
    )
