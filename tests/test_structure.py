"""The package's shape, read from its code (ast): no import circles, no other module's private names,
imports only downward through the floors, no torch where the planner and the search live.

The floors, lowest first; a module imports its own floor or a lower one, never a higher one nor a
floor beside it (cluster and runtime share a height and neither imports the other):

    base (errors, units, files, choices, lazy, progress) < graph < costs < planner < cluster | runtime < report < job < cli

``autopipe/__init__.py`` is the public face: it imports base modules and names any floor lazily
(``lazy_exports``). Every import counts, at module level or inside a function, and so does a name a
package face exports lazily (an edge to the module that defines it). Each failure names the file,
the line and the import, so the message says what to change.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autopipe"

BASE = ("errors", "units", "files", "choices", "lazy", "progress")
FLOORS = {"base": 0, "graph": 1, "costs": 2, "planner": 3, "cluster": 4, "runtime": 4, "report": 5, "job": 6, "cli": 7}
# plain numbers in, plain numbers out: these never import torch, not even inside a function
TORCH_FREE = ("autopipe.planner", "autopipe.cluster", "autopipe.costs.layer_costs", "autopipe.costs.rescale",
              "autopipe.costs.gpu_memory", "autopipe.costs.noise",
              *(f"autopipe.{name}" for name in BASE))


@dataclass(frozen=True)
class Import:
    """One name a module takes from another: ``target`` is the module that runs (a lazily exported
    name points at the module defining it), ``name`` the attribute taken from it (None: the module)."""

    source: str
    path: Path
    line: int
    target: str
    name: str | None
    lazy: bool = False

    def where(self) -> str:
        taken = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source} {'names lazily' if self.lazy else 'imports'} {taken}"


def _module_files() -> dict[str, Path]:
    """Every module of the package (files in folders that are packages), by dotted name."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if not all((ROOT.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            continue  # a data folder (a template, say), not a package
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _module_files()


def _lazy_names(tree: ast.Module, package: str) -> dict[str, tuple[str, int]]:
    """name -> (module, line) for a package face's ``lazy_exports(__name__, {name: submodule}, ...)``."""
    dicts = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
             for t in node.targets if isinstance(t, ast.Name)}
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" and len(node.args) >= 2:
            table = dicts.get(getattr(node.args[1], "id", ""), node.args[1])
            if isinstance(table, ast.Dict):
                for key, value in zip(table.keys, table.values):
                    if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                        target = value.value if value.value.startswith("autopipe.") else f"{package}.{value.value}"
                        out[key.value] = (target, value.lineno)
    return out


def _parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


LAZY = {m: _lazy_names(_parse(m), m) for m, p in MODULES.items() if p.name == "__init__.py"}


def _imports(module: str) -> list[Import]:
    """Every autopipe import in ``module`` (and every lazily exported name of a package face)."""
    path, tree = MODULES[module], _parse(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = [Import(module, path, line, target, None, lazy=True) for target, line in LAZY.get(module, {}).values()]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(module, path, node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "autopipe"]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
                else node.module or ""
            if base.split(".")[0] != "autopipe":
                continue
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:  # a submodule
                    out.append(Import(module, path, node.lineno, f"{base}.{a.name}", None))
                else:  # a name of a module, or one its package face exports lazily
                    target = LAZY.get(base, {}).get(a.name, (base, 0))[0]
                    out.append(Import(module, path, node.lineno, target, a.name))
    return out


def _private_attributes(module: str) -> list[str]:
    """``alias._name`` where the alias was bound by importing an autopipe module: a private name
    reached without naming it in the import."""
    tree = _parse(module)
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "autopipe":
                    bound[a.asname or "autopipe"] = a.name if a.asname else "autopipe"
    for imp in _imports(module):
        if imp.name is None and imp.target in MODULES:
            bound.setdefault(imp.target.rpartition(".")[2], imp.target)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id], *chain])
                if owner in MODULES and owner != module:
                    found.append(f"{MODULES[module].relative_to(ROOT)}:{node.lineno}: {module} reads {owner}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] == "__main__":  # `python -m autopipe`: the command line's other door
        return "cli"
    return "base" if parts[1] in BASE else parts[1]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself), Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _fail(problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"{len(problems)} {what}:\n  " + "\n  ".join(problems), pytrace=False)


ALL = [imp for module in MODULES for imp in _imports(module)]


def test_every_module_sits_on_a_floor() -> None:
    """A new top-level module or folder is given a place in FLOORS before the other checks can judge it."""
    _fail([f"{MODULES[m].relative_to(ROOT)}: {m} is on no floor: add its folder to FLOORS (or its name to BASE) "
           f"in tests/test_structure.py" for m in MODULES if _floor(m) not in (*FLOORS, "face")], "modules without a floor")


def test_no_import_circles() -> None:
    """No two modules import each other, directly or round a longer circle, at module level or inside a function."""
    edges: dict[str, set[str]] = {}
    for imp in ALL:
        if imp.target in MODULES:
            edges.setdefault(imp.source, set()).add(imp.target)
    problems = []
    for circle in _cycles(edges):
        inside = sorted({f"{imp.path.relative_to(ROOT)}:{imp.line}: {imp.source} -> {imp.target}"
                         for imp in ALL if imp.source in circle and imp.target in circle})
        problems.append(" <-> ".join(circle) + ": break one of\n      " + "\n      ".join(inside))
    _fail(problems, "import circles")


def test_no_module_takes_another_modules_private_names() -> None:
    """``from .x import _y`` (or ``x._y``) reaches into another module: make the name public, or move it."""
    problems = [imp.where() + ": a private name" for imp in ALL if
                (imp.name and _private(imp.name)) or any(_private(p) for p in imp.target.split("."))]
    problems += [line for module in MODULES for line in _private_attributes(module)]
    _fail(problems, "imports of private names")


def test_imports_only_go_down_the_floors() -> None:
    """Each import stays on its floor or goes to a lower one; the public face imports base modules and
    names the floors lazily."""
    problems = []
    for imp in ALL:
        here, there = _floor(imp.source), _floor(imp.target)
        if here == "face":
            if there not in ("base", "face") and not imp.lazy:
                problems.append(f"{imp.where()}: autopipe/__init__.py names the floors lazily (lazy_exports), "
                                f"so `import autopipe` loads no torch")
        elif there == "face":
            problems.append(f"{imp.where()}: import from the module that defines it, not the public face")
        elif there != here and (there not in FLOORS or FLOORS[there] >= FLOORS.get(here, -1)):
            problems.append(f"{imp.where()}: {here} (floor {FLOORS.get(here)}) may not import {there} "
                            f"(floor {FLOORS.get(there)}); move the shared piece down or the caller up")
    _fail(problems, "imports that climb")


# The runtime's rooms, lowest first: each imports its own room or a lower one; rooms of one floor
# never import each other (the two engines share the pieces beneath them, not each other's).
RUNTIME_FLOORS = {"stage": 0, "logs": 0, "checkpoints": 0, "data": 1, "process": 1, "training": 2,
                  "torch_engine": 3, "deepspeed_engine": 3, "checks": 4, "api": 5}


def _runtime_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["autopipe", "runtime"] else None


def test_the_runtime_s_rooms_import_only_downward() -> None:
    """Inside runtime/, a sub-package imports only rooms on a lower floor (RUNTIME_FLOORS): stage,
    logs and checkpoints at the bottom, then data and process, training, the two engines, the checks;
    a new room is given a floor before it can be judged."""
    problems = [f"{MODULES[m].relative_to(ROOT)}: runtime room {_runtime_room(m)!r} has no floor: add it to "
                "RUNTIME_FLOORS in tests/test_structure.py" for m in MODULES
                if _runtime_room(m) is not None and _runtime_room(m) not in RUNTIME_FLOORS]
    for imp in ALL:
        here, there = _runtime_room(imp.source), _runtime_room(imp.target)
        if here is None or there is None or here == there or here not in RUNTIME_FLOORS:
            continue
        if RUNTIME_FLOORS.get(there, 99) >= RUNTIME_FLOORS[here]:
            problems.append(f"{imp.where()}: runtime/{here} (floor {RUNTIME_FLOORS[here]}) may not import "
                            f"runtime/{there} (floor {RUNTIME_FLOORS.get(there)}); move the shared piece down")
    _fail(problems, "runtime imports that climb")


def _torch_free(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in TORCH_FREE)


def test_no_torch_import_where_the_plan_is_plain_numbers() -> None:
    """planner/, cluster/, the Profile record, rescaling and the base modules import no torch, even inside a function."""
    problems = []
    for module, path in MODULES.items():
        if not _torch_free(module):
            continue
        for node in ast.walk(_parse(module)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            problems += [f"{path.relative_to(ROOT)}:{node.lineno}: {module} imports {n}" for n in names
                         if n.split(".")[0] == "torch"]
    _fail(problems, "torch imports in torch-free modules")


_LOADS_NO_TORCH = textwrap.dedent('''
    import importlib, sys, traceback

    class Watch:
        """Remembers who imported torch first (the stack, autopipe frames only), then lets it load."""
        first = None
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers") and Watch.first is None:
                Watch.first = [f"{f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_stack()
                               if "/autopipe/" in f.filename]
            return None

    sys.meta_path.insert(0, Watch())
    for name in sys.argv[1:]:
        importlib.import_module(name)
        if "torch" in sys.modules:
            print(f"import {name} loaded torch, by way of:")
            print("\\n".join(Watch.first or ["(no autopipe frame)"]))
            raise SystemExit(1)
''')


def test_the_planner_and_the_search_load_without_torch() -> None:
    """``import autopipe, autopipe.planner, autopipe.cluster`` and every module in those folders leaves
    torch unloaded (a fresh interpreter); a failure shows the chain of imports that pulled it in."""
    names = ["autopipe", "autopipe.planner", "autopipe.cluster",
             *(m for m in MODULES if m.startswith(("autopipe.planner.", "autopipe.cluster.")))]
    done = subprocess.run([sys.executable, "-c", _LOADS_NO_TORCH, *names], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    if done.returncode != 0:
        pytest.fail(done.stdout + done.stderr[-3000:], pytrace=False)
