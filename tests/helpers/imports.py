"""The import graph of a package, read from its source (every import statement, also the ones
inside functions), and the cycles in it."""

from __future__ import annotations

import ast
import os


def module_names(root: str, package: str) -> dict[str, str]:
    """``{dotted module name: file}`` of every module under ``root`` (the package's folder)."""
    modules = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            relative = os.path.relpath(os.path.join(folder, name), root)[: -len(".py")]
            parts = [package, *relative.split(os.sep)]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The dotted names ``module``'s source imports: ``from a import b`` gives ``a.b`` (a module,
    or a name inside ``a``), ``import a.b`` gives ``a.b``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``; a name inside a module counts as that
    module, ``from pkg import sub`` as ``pkg.sub`` when that is a module."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        targets = set()
        for name in _imported(tree, module, path.endswith("__init__.py")):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_graph(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph between packages: every module collapsed to its first ``depth`` name parts."""
    collapsed: dict[str, set[str]] = {}

    def cut(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    for module, targets in graph.items():
        edges = collapsed.setdefault(cut(module), set())
        edges.update(cut(t) for t in targets if cut(t) != cut(module))
    return collapsed
