"""Shape limits of the package: one thing per file, functions that fit on a screen.

No module of ``asyncflow/`` over 400 lines (past that a file is two things) and no
function over 60 lines (the driver loop included). The failure names the offenders and
the largest of each, so a refactor knows where it stands.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "asyncflow"
MAX_FILE, MAX_FUNCTION = 400, 60


def _files() -> list[tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT.parent))) for p in ROOT.rglob("*.py")),
                  reverse=True)


def _functions() -> list[tuple[int, str]]:
    out = []
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(ROOT.parent)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def test_no_file_over_400_lines():
    files = _files()
    over = [f"{n} {name}" for n, name in files if n > MAX_FILE]
    assert not over, f"files over {MAX_FILE} lines: {over}"
    print(f"largest file: {files[0][1]} ({files[0][0]} lines)")


def test_no_function_over_60_lines():
    functions = _functions()
    over = [f"{n} {name}" for n, name in functions if n > MAX_FUNCTION]
    assert not over, f"functions over {MAX_FUNCTION} lines: {over}"
    print(f"largest function: {functions[0][1]} ({functions[0][0]} lines)")
