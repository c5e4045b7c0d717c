"""The layout rules of docs/design.md, checked on the source: no import cycle in `mrl/` (imports
inside functions and `if TYPE_CHECKING:` blocks count: a type-only cycle still couples the
modules for a reader and a type checker), small modules in
`mrl/train`, and a training loop with no branch on the rollout placement."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for p in (REPO / "mrl").rglob("*.py"):
        rel = p.relative_to(REPO).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The `mrl` modules `name` imports anywhere in its body (a `from pkg import mod` names the
    submodule when there is one)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    out.add(full)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module in mrl's import graph."""
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's algorithm
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
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_a_cycle_is_found():
    """The checker itself: modules importing one another inside functions, or only for type
    checking, are a cycle; a one-way import is not."""
    import tests.test_architecture as me

    real = me._modules
    fake = {"mrl.a": "def f():\n    from mrl.b import g\n", "mrl.b": "def g():\n    import mrl.a\n",
            "mrl.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mrl.d import f\n",
            "mrl.d": "import mrl.c\n", "mrl.e": "from mrl.a import f\n"}

    class Src:
        def __init__(self, name):
            self.name, self.text = "x.py", fake[name]

        def read_text(self):
            return self.text

    me._modules = lambda: {n: Src(n) for n in fake}
    try:
        assert sorted(sorted(c) for c in me.import_cycles()) == [["mrl.a", "mrl.b"], ["mrl.c", "mrl.d"]]
    finally:
        me._modules = real


def test_mrl_has_no_import_cycle():
    assert import_cycles() == []


def test_no_module_under_mrl_train_is_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in (REPO / "mrl/train").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_training_loop_does_not_branch_on_the_placement():
    tree = ast.parse((REPO / "mrl/train/loop.py").read_text())
    for node in ast.walk(tree):   # docstrings may say what the placements do; code may not ask
        if hasattr(node, "body") and isinstance(node.body, list):
            node.body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))] \
                or [ast.Pass()]
    code = ast.unparse(tree)   # without comments
    assert not [w for w in ("separate", "placement", "colocated") if w in code.lower()], code
