"""The package's layers only point down (docs/architecture.md draws them).

Walks every module's imports with ``ast`` (in-function imports included: hiding an
upward import inside a function does not make it downward) and fails on

* an import of a package from a higher layer than the importer's own;
* two top-level packages that import each other (even within one layer);
* ``import ray`` outside :mod:`asyncflow.launch` (roles stay plain classes);
* the data plane's core importing its transports;
* logic in a package ``__init__`` (only a docstring, imports and ``__all__``).
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parent.parent / "asyncflow"

# Lowest first. A package may import its own layer's packages (one way) and any layer below.
LAYERS = {
    "config": 0,
    "observe": 1, "dataplane": 1, "weights": 1, "algorithms": 1,
    "engines": 2,
    "agents": 3, "tasks": 3,
    "workflow": 4,
    "launch": 5,
    "bench": 6,
    "planner": 7,
    "api": 8,
    "cli": 9,
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(mod: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of ``path``."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(base, node.lineno)] + [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _top(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else mod


def _edges() -> dict[tuple[str, str], list[str]]:
    mods = _modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for mod, path in mods.items():
        for name, line in _imports(mod, path):
            if not name.startswith("asyncflow."):
                continue
            while name not in mods and "." in name:
                name = name.rpartition(".")[0]
            a, b = _top(mod), _top(name)
            if name in mods and a != b and a != "asyncflow" and b != "asyncflow":
                edges[(a, b)].append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    return edges


def test_every_top_level_package_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert tops == set(LAYERS), f"give these a layer in LAYERS: {sorted(tops ^ set(LAYERS))}"


def test_imports_only_point_down():
    upward = [where for (a, b), sites in _edges().items() if LAYERS[b] > LAYERS[a] for where in sites]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_two_packages_import_each_other():
    edges = _edges()
    mutual = sorted({tuple(sorted(pair)) for pair in edges if (pair[1], pair[0]) in edges})
    assert not mutual, "packages importing each other: " + ", ".join(f"{a} <-> {b}" for a, b in mutual)


def test_ray_only_in_the_launcher():
    offenders = [f"{path.relative_to(ROOT.parent)}:{line}" for mod, path in _modules().items()
                 for name, line in _imports(mod, path)
                 if name.split(".")[0] == "ray" and _top(mod) != "launch"]
    assert not offenders, "import ray outside asyncflow/launch: " + ", ".join(offenders)


def test_data_plane_core_does_not_import_its_transports():
    offenders = [f"{path.relative_to(ROOT.parent)}:{line}" for mod, path in _modules().items()
                 if mod.startswith("asyncflow.dataplane.core")
                 for name, line in _imports(mod, path) if name.startswith("asyncflow.dataplane.transport")]
    assert not offenders, offenders


def test_package_inits_hold_no_logic():
    for init in ROOT.rglob("__init__.py"):
        for node in ast.parse(init.read_text()).body:
            ok = isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) or (
                isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] in (["__all__"], ["__version__"]))
            assert ok, f"{init.relative_to(ROOT.parent)}:{node.lineno}: logic in a package __init__ (move it to a module)"


def test_rollout_takes_no_untyped_parameters():
    """Issue 35: rollout's package passes its role and state typed (``RolloutRole``, ``RolloutState``),
    so mypy sees the interface: no parameter of a function there is annotated ``Any``."""
    untyped = [f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}({arg.arg})"
               for path in sorted((ROOT / "workflow" / "rollout").glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
               if arg.annotation is not None and ast.unparse(arg.annotation).strip("'\"") == "Any"]
    assert not untyped, untyped


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk itself can fail: an in-function upward import is found."""
    pkg = tmp_path / "asyncflow"
    for d in ("config", "cli"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "x.py").write_text("def f():\n    from asyncflow.cli import main\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert ("config", "cli") in _edges()
