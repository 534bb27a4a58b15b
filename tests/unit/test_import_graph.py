"""The package's module structure: every module imports in a fresh interpreter, the graph of top-level imports
between cupy_ep's modules has no cycle, and no module reaches into the backend's private state the way the paths
once did (the runtime objects are handed to them instead)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cupy_ep"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top_level_imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """cupy_ep modules that ``name`` imports at module level (inside ``if``/``try`` at module level too, not inside
    functions or classes, which run later)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.Try)):
            stack.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target in modules:
                found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
    return found - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_module_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _top_level_imports(name, path, modules) for name, path in modules.items()}
    assert "cupy_ep.cuda.backend" in graph and "cupy_ep.host.backend" in graph
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(_modules())
    optional = {"cupy_ep.deep_ep", "cupy_ep.torch"}  # need torch
    code = ("import importlib, importlib.util, sys\n"
            f"names, optional = {names!r}, {sorted(optional)!r}\n"
            "have_torch = importlib.util.find_spec('torch') is not None\n"
            "for name in names:\n"
            "    if name in optional and not have_torch:\n"
            "        continue\n"
            "    importlib.import_module(name)\n"
            "print('imported', len(names))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "CUPY_EP_PREINIT": "0"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"imported {len(names)}" in result.stdout


def test_the_paths_do_not_reach_into_the_backend():
    """The CUDA paths get what they use as objects (the backend's public attributes); none reads the backend's
    private members (``buf._x`` / ``self.buf._x``)."""
    import re
    pattern = re.compile(r"\bbuf\._[a-z]")
    offenders = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
                 for path in sorted((PACKAGE / "cuda").glob("*.py")) if path.name != "backend.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
