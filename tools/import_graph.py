"""The import graph of offload/, checked against its layers.

    python tools/import_graph.py            # layers, their edges, the largest files; exit 1 on a violation
    python tools/import_graph.py --modules  # also every module's imports of offload

The folders are the layers (docs/architecture.md), bottom to top, in `LAYERS`. Every
`import` / `from ... import` in offload/ is read from the source (also those inside
functions and under TYPE_CHECKING: a lazy import is a dependency all the same), and three
rules are checked:

1. **downward only**: a module imports modules of its own layer or of layers below;
2. **no circle**: no two modules import each other, directly or around a loop;
3. **no cross-file private import**: `from offload.x import _name` from another file.

tests/test_layers.py runs the same checks, and also imports each layer in a fresh
interpreter to see that nothing above it gets loaded.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("offload._native", "offload._C", "offload.sizes", "offload.dtypes", "offload.devices",
              "offload.device_runtime")),
    ("models", ("offload.models",)),
    ("config", ("offload.config",)),
    ("storage", ("offload.storage",)),
    ("units", ("offload.units",)),
    ("optim", ("offload.optim",)),
    ("runtime", ("offload.runtime",)),
    ("checkpoint", ("offload.checkpoint",)),
    ("plan", ("offload.plan",)),
    ("api", ("offload.engine", "offload.meta_init", "offload.checkpointing", "offload")),
    ("compat", ("offload.compat",)),
    ("integrations", ("offload.integrations",)),
]
"""Bottom to top. A module belongs to the layer of its longest matching prefix."""


def layer_of(module: str) -> Optional[int]:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


@dataclass
class Module:
    name: str
    path: str
    lines: int
    imports: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    """offload module imported -> [(line, imported name or '')]"""


def _module_name(path: str, root: str = ROOT) -> str:
    rel = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def scan(root: str = ROOT) -> dict[str, Module]:
    """Every module of offload/ with the offload modules it imports."""
    mods: dict[str, Module] = {}
    for dirpath, _, files in os.walk(os.path.join(root, "offload")):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8") as fh:
                src = fh.read()
            name = _module_name(path, root)
            mods[name] = Module(name, path, src.count("\n"))
            mods[name].imports = _imports(ast.parse(src, path), name, path)
    known = set(mods) | {"offload._C"}  # the native extension (a .so)
    for m in mods.values():  # `from offload.x import y` where y is a module: an edge to offload.x.y
        for target, uses in list(m.imports.items()):
            for line, name in uses:
                sub = f"{target}.{name}"
                if name and sub in known:
                    m.imports.setdefault(sub, []).append((line, ""))
    return mods


def _imports(tree: ast.AST, module: str, path: str) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "offload" or a.name.startswith("offload."):
                    out.setdefault(a.name, []).append((node.lineno, ""))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "offload" or target.startswith("offload."):
                for a in node.names:
                    out.setdefault(target, []).append((node.lineno, a.name))
    return out


def violations(mods: dict[str, Module]) -> list[str]:
    """Every broken rule, as a line naming the file, the line and what to do."""
    out: list[str] = []
    for m in sorted(mods.values(), key=lambda m: m.name):
        lm = layer_of(m.name)
        if lm is None:
            out.append(f"{m.path}: module {m.name} is in no layer; add its folder to LAYERS "
                       "(tools/import_graph.py) and to docs/architecture.md")
            continue
        for target, uses in sorted(m.imports.items()):
            lt = layer_of(target)
            line = uses[0][0]
            rel = os.path.relpath(m.path, ROOT)
            if target == "offload" and all(name == "" or f"offload.{name}" in mods or name == "_C"
                                           for _, name in uses):
                continue  # `import offload.x.y`, `from offload import _C`: the module, not the package
            if lt is not None and lt > lm:
                out.append(f"{rel}:{line}: {m.name} ({LAYERS[lm][0]}) imports {target} "
                           f"({LAYERS[lt][0]}), a layer above it")
            for ln, name in uses:
                if name.startswith("_") and not name.startswith("__") and target != m.name \
                        and f"{target}.{name}" not in mods and name != "_C":
                    out.append(f"{rel}:{ln}: {m.name} imports the private name {name!r} of "
                               f"{target}; make it public where it belongs, or move the caller")
    for cycle in cycles(mods):
        out.append("import circle: " + " -> ".join(cycle + [cycle[0]]))
    return out


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph = {n: [t for t in m.imports if t in mods and t != n and not _is_parent(t, n)]
             for n, m in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_parent(package: str, module: str) -> bool:
    """A package's __init__ re-exporting its own modules is not a circle with them."""
    return module.startswith(package + ".")


def layer_edges(mods: dict[str, Module]) -> dict[tuple[str, str], int]:
    edges: dict[tuple[str, str], int] = {}
    for m in mods.values():
        lm = layer_of(m.name)
        for target in m.imports:
            lt = layer_of(target)
            if lm is None or lt is None or lt == lm or target == "offload":
                continue
            key = (LAYERS[lm][0], LAYERS[lt][0])
            edges[key] = edges.get(key, 0) + 1
    return edges


def main(argv: list[str]) -> int:
    mods = scan()
    print("layers, bottom to top (a layer imports only from itself and the layers listed before it):")
    for i, (name, prefixes) in enumerate(LAYERS):
        members = sorted(n for n in mods if layer_of(n) == i)
        print(f"  {i}. {name:<12} {', '.join(p.replace('offload.', '') for p in prefixes)}"
              f"  ({len(members)} modules, {sum(mods[n].lines for n in members)} lines)")
    print("\nlayer -> layers it imports (number of modules importing):")
    edges = layer_edges(mods)
    for name, _ in LAYERS:
        outs = sorted(((b, n) for (a, b), n in edges.items() if a == name),
                      key=lambda bn: [x for x, _ in LAYERS].index(bn[0]))
        print(f"  {name:<12} -> {', '.join(f'{b} ({n})' for b, n in outs) or '-'}")
    if "--modules" in argv:
        print("\nmodule -> offload modules it imports:")
        for n in sorted(mods):
            print(f"  {n} -> {', '.join(sorted(t for t in mods[n].imports if t in mods)) or '-'}")
    print("\nlargest files:")
    for m in sorted(mods.values(), key=lambda m: -m.lines)[:12]:
        print(f"  {m.lines:5d}  {os.path.relpath(m.path, ROOT)}")
    bad = violations(mods)
    print(f"\n{len(bad)} violation(s)" + (":" if bad else ""))
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
