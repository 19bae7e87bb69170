"""Imports stay at module level unless there is a reason, and the light entry points stay light.

* ``import asyncflow.cli`` and ``import asyncflow.config`` import neither torch, nor Ray, nor
  transformers (``asyncflow --help`` and config loading stay instant);
* an import inside a function is kept only for an optional heavy dependency (ray, vllm,
  sglang, matplotlib, pyarrow, datasets, transferqueue) or to keep the CLI fast, and says
  why in a comment on its line (or the line above).
"""

from __future__ import annotations

import ast
import io
import json
import pathlib
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "asyncflow"
HEAVY = ("torch", "ray", "transformers")

EXEMPT: set[str] = set()  # files allowed to fall short (none)


@pytest.mark.parametrize("module", ["asyncflow.cli", "asyncflow.config"])
def test_light_entry_points_import_no_heavy_package(module):
    code = (f"import json, sys; import {module}; "
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [], f"import {module} pulled in {out.strip()}"


def _in_function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in out:
                    out.append(node)
    return out


def _comment_lines(src: str) -> tuple[set[int], set[int]]:
    """(lines with a comment, lines that hold only a comment)."""
    commented, alone = set(), set()
    lines = src.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            commented.add(row)
            if lines[row - 1].strip().startswith("#"):
                alone.add(row)
    return commented, alone


def lazy_imports(exempt: set[str] = EXEMPT) -> tuple[list[str], list[str]]:
    """('path:line import' of every in-function import, those of them without a reason)."""
    every, bare = [], []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel in exempt:
            continue
        src = path.read_text()
        commented, alone = _comment_lines(src)
        lines = src.splitlines()
        for node in _in_function_imports(ast.parse(src)):
            where = f"{rel}:{node.lineno} {lines[node.lineno - 1].strip()}"
            every.append(where)
            span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            if not (any(r in commented for r in span) or node.lineno - 1 in alone):
                bare.append(where)
    return every, bare


def test_every_in_function_import_says_why():
    every, bare = lazy_imports()
    print(f"\n{len(every)} in-function imports outside the exempt files:\n" + "\n".join(every))
    assert not bare, ("in-function imports without a reason (move them to module level, or say on the "
                      "line why they must stay lazy):\n" + "\n".join(bare))


def test_exempt_files_exist_or_are_expected():
    stale = [p for p in EXEMPT if not (ROOT.parent / p).exists() and p != "asyncflow/config/docs.py"]
    assert not stale, f"exempt files that no longer exist: {stale}"
