"""The layout rules of docs/design.md, checked on the source: no import cycle in `mrl/` (imports
inside functions and `if TYPE_CHECKING:` blocks count: a type-only cycle still couples the
modules for a reader and a type checker), imports point down the floors (`FLOORS`; the schema
package at the bottom imports nothing of mrl above it; the few imports that run back up are
listed, each with its reason), small modules (under 500 lines, under 400 in `mrl/train`; declared
data exempt), and a training loop with no branch on the rollout placement."""
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



class _FakeSource:
    """A module source for the checkers' self-tests: a name and a text instead of a file."""

    def __init__(self, text: str):
        self.name, self.text = "x.py", text

    def read_text(self) -> str:
        return self.text


def _fake_modules(fake: dict[str, str]):
    """A stand-in for `_modules`: module name -> source, from `fake` (name -> text)."""
    return lambda: {n: _FakeSource(t) for n, t in fake.items()}

def test_a_cycle_is_found():
    """The checker itself: modules importing one another inside functions, or only for type
    checking, are a cycle; a one-way import is not."""
    import tests.test_architecture as me

    real = me._modules
    fake = {"mrl.a": "def f():\n    from mrl.b import g\n", "mrl.b": "def g():\n    import mrl.a\n",
            "mrl.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mrl.d import f\n",
            "mrl.d": "import mrl.c\n", "mrl.e": "from mrl.a import f\n"}

    me._modules = _fake_modules(fake)
    try:
        assert sorted(sorted(c) for c in me.import_cycles()) == [["mrl.a", "mrl.b"], ["mrl.c", "mrl.d"]]
    finally:
        me._modules = real


def test_mrl_has_no_import_cycle():
    assert import_cycles() == []


# mrl's floors, bottom to top: a module imports modules of its own floor or below. A name is a
# package or a top-level module; `mrl` itself is the root package (its version).
FLOORS: tuple[frozenset[str], ...] = tuple(frozenset(f) for f in (
    {"mrl", "mrl.errors", "mrl.schema"},                               # schema machinery, errors
    {"mrl.platform"},                                                   # process groups, devices, CPU layer
    {"mrl.models", "mrl.weights"},                                      # architectures, weight mapping
    {"mrl.batch", "mrl.algos", "mrl.optim", "mrl.engine"},              # pure algorithms, the training engine
    {"mrl.data", "mrl.reward", "mrl.rollout"},                          # prompts, rewards, generation
    {"mrl.checkpoint", "mrl.outputs", "mrl.tracking"},                  # run state on disk, records
    {"mrl.train", "mrl.sft"},                                           # the RL and SFT loops
    {"mrl.config"},                                                     # job roots, loader, resolve, check
    {"mrl.merge", "mrl.offline", "mrl.compare", "mrl.convert", "mrl.preflight"},   # command bodies
    {"mrl.cli", "mrl.__main__"},                                        # the `mrl` command
))

# The imports that still run back up the floors, and why (importer -> imported).
UP_IMPORTS: dict[tuple[str, str], str] = {
    ("mrl.train.build", "mrl.config.job"): "the RL loop's input is the whole JobSpec the config floor assembles "
                                            "from train's own sections (a type annotation)",
    ("mrl.train.loop", "mrl.config.job"): "same: `train(spec: JobSpec)`",
    ("mrl.train.parts", "mrl.config.job"): "same: `Run.spec` (a TYPE_CHECKING import)",
    ("mrl.data.prepare", "mrl.outputs"): "`mrl data` refuses to write into a checkpoint (outputs asks the "
                                         "checkpoint store), one rule for every command that writes",
}


def floor_of(module: str) -> int:
    """The floor of a module: that of its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for i, names in enumerate(FLOORS):
            if name in names:
                return i
    raise KeyError(f"{module}: on no floor of tests/test_architecture.py::FLOORS")


def up_imports() -> list[tuple[str, str]]:
    """(importer, imported) for every import from a lower floor to a higher one."""
    modules = _modules()
    return sorted((m, d) for m, p in modules.items() for d in _imports(m, p, modules) if floor_of(d) > floor_of(m))


def test_an_up_import_is_found():
    """The checker itself: an import from a lower floor to a higher one is found, inside a function
    too; one down or within a floor is not."""
    import tests.test_architecture as me

    real = me._modules
    fake = {"mrl.schema.x": "def f():\n    from mrl.config.job import JobSpec\n",
            "mrl.config.job": "from mrl.schema.x import f\nfrom mrl.config import loader\n",
            "mrl.config.loader": "", "mrl.train.loop": "import mrl.platform\n", "mrl.platform": ""}

    me._modules = _fake_modules(fake)
    try:
        assert me.up_imports() == [("mrl.schema.x", "mrl.config.job")]
    finally:
        me._modules = real


def test_every_module_is_on_a_floor():
    assert [m for m in _modules() if not _on_a_floor(m)] == []


def _on_a_floor(module: str) -> bool:
    try:
        floor_of(module)
    except KeyError:
        return False
    return True


def test_imports_point_down_the_floors_but_the_listed_few():
    assert [u for u in up_imports() if u not in UP_IMPORTS] == []
    assert len(UP_IMPORTS) <= 4


def test_the_schema_package_imports_nothing_of_mrl_above_it():
    modules = _modules()
    schema = {m: p for m, p in modules.items() if m == "mrl.schema" or m.startswith("mrl.schema.")}
    assert schema
    assert {m: sorted(d for d in _imports(m, p, modules) if not d.startswith("mrl.schema"))
            for m, p in schema.items()} == {m: [] for m in schema}


# Declared data: modules that are tables or a port kept whole, exempt from the 500-line rule.
LONG_DATA = {
    "mrl/reward/prime_math.py": "a port of verl's math grader (PRIME's), kept in verl's order to diff against it",
}


def test_no_module_is_500_lines_or_more_except_declared_data():
    assert all((REPO / p).is_file() for p in LONG_DATA)
    long = {str(p.relative_to(REPO)): n for p in (REPO / "mrl").rglob("*.py")
            if (n := len(p.read_text().splitlines())) >= 500 and str(p.relative_to(REPO)) not in LONG_DATA}
    assert not long, long


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
