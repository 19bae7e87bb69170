"""``docs/configuration.md`` is generated from the config models and must match them.

The page is checked in so that it can be read on the web; this test fails the moment a
field, its default or its description changes without the page being regenerated.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from asyncflow.config import RunConfig
from asyncflow.config.docs import COMMAND, render

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


def test_configuration_page_is_up_to_date():
    assert PAGE.is_file(), f"docs/configuration.md is missing: run `{COMMAND}`"
    assert PAGE.read_text() == render(), (
        f"docs/configuration.md differs from the config models: regenerate it with `{COMMAND}` "
        "(from the repository root) and commit the result")


def _all_fields(model: type[BaseModel] = RunConfig, prefix: str = ""):
    """(dotted key, FieldInfo) of every config field: the top-level ones and each section's,
    a section within a section (``model.lora``) included."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _all_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def test_every_field_is_documented_and_on_the_page():
    page = render()
    keys = list(_all_fields())
    assert len(keys) > 50
    for key, field in keys:
        assert field.description, f"config field '{key}' has no description (Field(description=...))"
        assert f"| `{key}` |" in page, f"config field '{key}' is missing from the generated page"


def test_the_module_prints_the_page_and_imports_no_torch():
    code = ("import sys; "
            "import asyncflow.config.docs as d; assert 'torch' not in sys.modules, 'torch imported'; "
            "sys.exit(d.main([]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == render()


def test_write_writes_the_page(tmp_path):
    from asyncflow.config.docs import main

    target = tmp_path / "configuration.md"
    assert main(["--write", str(target)]) == 0
    assert target.read_text() == render()
