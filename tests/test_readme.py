"""The README is the front door: short, and every command and link in it works.

* it has at most 250 lines (everything else lives under ``docs/``);
* every ``asyncflow ...`` command in its fenced code blocks is accepted by the CLI's parser;
* the cheap ones run: ``--help``, and each ``asyncflow train ...`` with ``--dry-run``
  (config loading and validation, no training);
* every relative link in it, and in the docs it links to, points at a file that exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 250


def _fenced_lines(text: str) -> list[str]:
    """The lines inside ``` fences, with backslash continuations joined."""
    out, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        out.append(line)
    return out


def readme_commands(text: str | None = None) -> list[list[str]]:
    """Every ``asyncflow ...`` command of the README's code blocks, as argv without the program
    name (``a && asyncflow train`` counts; comments are dropped; other lines are skipped)."""
    text = README.read_text() if text is None else text
    cmds = []
    for line in _fenced_lines(text):
        for part in re.split(r"&&|;", line.removeprefix("$ ")):
            part = part.strip()
            if part == "asyncflow" or part.startswith("asyncflow "):
                argv = shlex.split(part, comments=True)
                cmds.append(argv[1:])
    return cmds


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; keep it at most {MAX_LINES} (move the rest to docs/)"


def section(heading: str) -> list[str]:
    """The non-empty lines of the README section ``## heading`` (heading excluded)."""
    lines, out, inside = README.read_text().splitlines(), [], False
    for line in lines:
        if line.startswith("## "):
            inside = line == f"## {heading}"
        elif inside and line.strip():
            out.append(line)
    return out


@pytest.mark.parametrize("heading,limit", [("Resuming and failures", 20), ("Your own task, reward and model", 25)])
def test_readme_sections_stay_short(heading, limit):
    got = section(heading)
    assert 0 < len(got) <= limit, f"README section '{heading}' has {len(got)} non-empty lines; keep it at most {limit}"


def test_the_command_finder_sees_what_it_should():
    text = ("```bash\npip install x && asyncflow train   # go\n$ asyncflow bench --repeat 1\n```\n"
            "asyncflow train not-in-a-fence\n```\nasyncflow train a=1 \\\n    b=2\nheld-out accuracy 1%\n"
            "asyncflow/cli.py   the CLI\n```\n")
    assert readme_commands(text) == [["train"], ["bench", "--repeat", "1"], ["train", "a=1", "b=2"]]


def test_readme_has_the_commands_it_promises():
    cmds = readme_commands()
    assert ["train"] in cmds, "the set-up command runs `asyncflow train`"
    assert {c[0] for c in cmds} >= {"train", "bench", "profile", "plan"}


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(["asyncflow", *a])[:80])
def test_readme_command_parses(argv):
    try:
        cli._parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`asyncflow {shlex.join(argv)}` (README) is rejected by the CLI parser (exit {e.code})")


def _train_commands() -> list[list[str]]:
    # plan=auto profiles this machine (torch, a minute) before --dry-run can print: parse-only
    return [c for c in readme_commands() if c[0] == "train" and "plan=auto" not in c]


@pytest.mark.parametrize("argv", _train_commands(), ids=lambda a: " ".join(["asyncflow", *a])[:80])
def test_readme_train_command_dry_runs(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(ROOT)  # README paths (asyncflow/configs/...) are relative to the repository
    # a user's own reward file the README names as an example (reward.fn=rewards.py:score): --dry-run
    # checks that the file exists, so the test gives it one, in tmp_path
    for i, a in enumerate(argv):
        file = a.partition("=")[2].rpartition(":")[0] if a.startswith("reward.fn=") else ""
        if file and not (ROOT / file).exists():
            (tmp_path / file).write_text("def score(prompt, response, sample):\n    return 0.0\n")
            argv = [*argv[:i], f"reward.fn={tmp_path / a.partition('=')[2]}", *argv[i + 1:]]
    assert cli.main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "mode:" in out and "train:" in out  # the resolved config, as YAML


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert "usage: asyncflow" in capsys.readouterr().out


def test_the_module_runs_as_a_command():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "asyncflow.cli", "train", "--dry-run", "train.steps=3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "steps: 3" in out.stdout


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    """Link targets of a markdown page that are not URLs (code blocks and spans hold none)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1.. for repeats."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _pages() -> list[Path]:
    """The README and every markdown page it links to, and the pages those link to."""
    pages, todo = [], [README]
    while todo:
        page = todo.pop()
        if page in pages:
            continue
        pages.append(page)
        for target in _links(page):
            path = (page.parent / target.split("#")[0]).resolve()
            if path.suffix == ".md" and path.is_file() and ROOT in path.parents:
                todo.append(path)
    return pages


def test_readme_links_to_the_docs():
    linked = {p.relative_to(ROOT).as_posix() for p in _pages()}
    assert {"docs/architecture.md", "docs/configuration.md", "docs/benchmarks.md"} <= linked


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_and_headings(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
