"""``docs/configuration.md``, generated from the pydantic models of :mod:`asyncflow.config.schema`.

Every config field is documented once, in its ``Field(description=...)``; this module turns
the models into a markdown page (one table per section: key, type, default, description)
so the page cannot drift from the code. ``tests/test_config_docs.py`` fails when the
checked-in page differs from :func:`render`.

    python -m asyncflow.config.docs                                # print the page
    python -m asyncflow.config.docs --write docs/configuration.md  # regenerate it

Light, as the rest of the config package: pydantic and the standard library only (no torch).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from asyncflow.config.schema import RunConfig

COMMAND = "python -m asyncflow.config.docs --write docs/configuration.md"

# What each section is for (one line each; the fields document themselves).
SECTIONS = {
    "model": "The policy: a local Hugging Face causal LM folder, or the built-in tiny model (its size is set here).",
    "task": "What the model is asked and how held-out accuracy is measured: a built-in task, a local dataset, "
            "or your own task by import path.",
    "warmstart": "The SFT warm-start of the built-in tiny model before RL (cached on disk).",
    "rollout": "Generation: sampling, the inference engine, what happens at a weight swap, over-provisioning.",
    "reward": "How answers are scored: the task's own reward, or your function by import path; where it runs.",
    "algorithm": "Advantage estimator, policy loss, KL, off-policy corrections, PPO's critic, DAPO's pieces.",
    "train": "The trainer: steps, batch, optimizer, micro-batches, evaluation, data parallelism.",
    "resources": "Where things run: threads, the data plane's deployment, core pinning, the device.",
    "eval": "What the held-out evaluation measures (named in the progress bar, metrics.jsonl and the summary).",
    "log": "Where metrics go: metrics.jsonl, TensorBoard, Weights & Biases (offline), MLflow.",
}

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _type(t: Any) -> str:
    """A type annotation as a user reads it (``null`` for None, ``a, b or c`` for a Literal)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    return getattr(t, "__name__", str(t))


def _constraints(info: FieldInfo) -> str:
    out = []
    for m in info.metadata:
        out += [f"{sym} {getattr(m, attr)}" for attr, sym in _BOUNDS if getattr(m, attr, None) is not None]
        if getattr(m, "pattern", None):
            out.append(f"matches {m.pattern}")
    return ", ".join(out)


def _value(v: Any) -> str:
    """A default as it is written in YAML or in a ``key=value`` override."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def _default(info: FieldInfo) -> Any:
    return info.get_default(call_default_factory=True)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _table(prefix: str, fields: dict[str, FieldInfo]) -> list[str]:
    return ["| key | type | default | description |", "|---|---|---|---|", *_rows(prefix, fields)]


def _rows(prefix: str, fields: dict[str, FieldInfo]) -> list[str]:
    """One row a field; a nested section (``model.lora``) as its own fields' rows, ``model.lora.r``..."""
    lines = []
    for name, info in fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            lines += _rows(f"{prefix}{name}.", info.annotation.model_fields)
            continue
        typ = _type(info.annotation)
        bounds = _constraints(info)
        typ = f"{typ} ({bounds})" if bounds else typ
        lines.append(f"| {_code(prefix + name)} | {_cell(typ)} | {_code(_value(_default(info)))} "
                     f"| {_cell(info.description or '')} |")
    return lines


def _sections() -> tuple[dict[str, FieldInfo], dict[str, type[BaseModel]]]:
    """RunConfig's own fields, and its sections (the fields that are models)."""
    top, sections = {}, {}
    for name, info in RunConfig.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sections[name] = ann
        else:
            top[name] = info
    return top, sections


def render() -> str:
    """The whole ``docs/configuration.md`` page."""
    top, sections = _sections()
    out = [
        "# Configuration",
        "",
        f"<!-- Generated from asyncflow/config/schema.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every field of the run config, generated from the pydantic models in",
        "`asyncflow/config/schema.py` (the one place a field is documented). Set a field in a YAML",
        "file (`asyncflow train my.yaml`) or on the command line as `section.key=value`",
        "(`asyncflow train train.steps=20 mode=sync`); `asyncflow train --dry-run ...` prints the",
        "resolved config. A value is validated when the config loads: a misspelt key, a value out",
        "of range or two fields that do not fit together is a one-line error naming the field and",
        "the fix. Checks across fields (e.g. `task.name=dataset` needs `task.path` and",
        "`model.path`) are in `RunConfig._consistent` and the sections' validators.",
        "",
        "Sections: " + ", ".join(f"[`{s}`](#{s})" for s in ["run", *sections]) + ".",
        "",
        "## run",
        "",
        "`RunConfig`'s own fields (the whole job): the mode and its staleness bound, the planner, the",
        "launcher, the seed, the run folder, the progress bar.",
        "",
        *_table("", top),
    ]
    for name, model in sections.items():
        out += ["", f"## {name}", "", f"`{model.__name__}`. {SECTIONS.get(name, '')}".rstrip(), "",
                *_table(name + ".", model.model_fields)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncflow.config.docs", description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="PATH", help="write the page here instead of printing it")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        Path(args.write).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
