"""The package's import structure, read from the source (nothing is imported): the core
never imports an engine or an adapter, and no import cycle exists, at module level or
through imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
ENGINES = ("vllm", "sglang", "sgl_kernel")
ADAPTERS = ("specplug.vllm_eagle3", "specplug.sglang_medusa")

def module_files() -> dict[str, Path]:
    """{dotted module name: file} of every module under plugins/ (installed as specplug)."""
    out = {}
    for path in PLUGINS.rglob("*.py"):
        parts = path.relative_to(PLUGINS).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("specplug",) + parts)] = path
    return out


def imported(name: str, path: Path, known: set[str], top_level: bool) -> set[str]:
    """Modules `name` imports (`top_level`: only at module level, guards included): known
    specplug modules where the import names one, else the imported name as written."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = _top_level(tree.body) if top_level else ast.walk(tree)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            subs = {f"{base}.{alias.name}" for alias in node.names} & known
            out.update(subs or {base})
    out.discard(name)
    return out


def _top_level(body):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.Try, ast.If)):
            yield from _top_level(node.body)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module
    parts = package.split(".")
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return groups


def graph(top_level: bool) -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported(name, path, known, top_level) & known for name, path in files.items()}


def test_the_core_never_imports_an_engine_or_an_adapter():
    files = module_files()
    found = []
    for name, path in files.items():
        if not name.startswith("specplug.common"):
            continue
        for target in imported(name, path, set(files), top_level=False):
            if target.split(".")[0] in ENGINES or target.startswith(ADAPTERS):
                found.append(f"{name} imports {target}")
    assert not found, "the core (plugins/common) must stay engine-free: " + "; ".join(found)


def test_no_import_cycle_at_module_level():
    found = cycles(graph(top_level=True))
    assert not found, f"module-level import cycles: {[sorted(g) for g in found]}"


def test_no_import_cycle_through_function_level_imports():
    found = [sorted(g) for g in cycles(graph(top_level=False))]
    assert not found, (f"import cycles (through function-level imports): {found}; split the modules instead of "
                       "hiding the cycle behind an import inside a function")


def test_the_cycle_finder_finds_a_cycle():
    """Negative control: a three-module ring and a self-contained pair are found, a chain is not."""
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(map(sorted, cycles(ring))) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
