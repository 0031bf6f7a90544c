"""The import graph of the project's packages (the modules of megatron/, zero_cache/, ptm_launch/, ptm_planner/
and tools/; module-level and function-level imports alike, since a cycle hidden inside a function is still a
cycle): it has no strongly connected component of more than one module, and the argument parser reaches no
backend and no engine module (zero_cache.config, plain JSON parsing, only).

An edge goes to the most specific module an import names: ``from pkg import mod`` is an edge to ``pkg.mod``
when that is a module, else to ``pkg`` (a name defined in its ``__init__``). A module that calls
``import_module`` (a package's lazy ``__getattr__``) has an edge to every project module named by a string
literal in it. Parent packages that Python initialises on the way are not edges: a package ``__init__`` that
re-exports its modules would otherwise be in a cycle with every module that imports a sibling by its full name.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("megatron", "zero_cache", "ptm_launch", "ptm_planner", "tools")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules that module ``name`` (at ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets, literals, lazy = set(), set(), False
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            literals.add(node.value)
        elif isinstance(node, ast.Name) and node.id == "import_module":
            lazy = True
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets | (literals if lazy else set()) if t in modules and t != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return sorted(found)


def test_cycles_finds_a_cycle_and_ignores_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "zero_cache.checkpoint.errors" in graph["zero_cache.checkpoint.slices"]  # `from .errors import ...`
    assert "megatron.training.arguments.parse" in graph["megatron.training.arguments"]  # lazy __getattr__


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    lines = [" <-> ".join(component) + "   edges: " + "; ".join(
        f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component) for component in found]
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_the_argument_parser_reaches_no_backend_and_no_engine_module():
    graph = import_graph()
    reached, todo = set(), ["megatron.training.arguments"]
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    # The parser reads the DeepSpeed JSON (zero_cache.config) and, for --use-checkpoint-args, a checkpoint's saved
    # arguments (the checkpoint format and the leaf modules it uses); nothing that builds or runs an engine.
    readers = {"zero_cache.config", "zero_cache.aio", "zero_cache.comm", "zero_cache.partition"}
    engine = sorted(m for m in reached if m.startswith(("zero_cache", "megatron.training.backends"))
                    and m not in readers and not m.startswith("zero_cache.checkpoint"))
    assert engine == [], f"the argument parser imports {engine}"
    assert "zero_cache.config" in reached
