"""Loading a configuration: YAML file + ``key=value`` overrides, validated at load.

User mistakes raise :class:`~asyncflow.config.schema.ConfigError` with one line that names
the field, the bad value and the fix (with a "did you mean" for a misspelt key). Light: no
torch here.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from asyncflow.config.schema import ConfigError, RunConfig


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load ``path`` (YAML; None = defaults) and apply ``key=value`` overrides, then validate."""
    data: dict[str, Any] = {}
    loaded: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found (give a YAML file, or none for the built-in default)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(loaded).__name__}")
        data = _relative_to(loaded, p.resolve().parent)
    given = {item.partition("=")[0].strip(): item for item in overrides}  # dotted key -> 'key=value'
    for item in overrides:
        _apply_override(data, item)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, _source(e, path, given, loaded))) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` where PyYAML knows the place (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _source(e: ValidationError, path: Any, given: dict[str, str], loaded: dict) -> str | None:
    """Where the offending values came from: the file, the command line, or both (a field's
    error names its own key; a cross-field check's message names the keys it compares)."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    keys = [loc] if err["type"] != "value_error" else [
        k for k in re.findall(r"\b[a-z_]+\.[a-z_.]+[a-z_]\b", err["msg"]) if _is_key(k)]  # (not torch.distributed)
    cli = [given[k] for k in dict.fromkeys(keys) if k in given]
    if not cli:
        return f"'{path}'" if path else None
    rest = [k for k in dict.fromkeys(keys) if k not in given and k != loc]
    where = [f"{k} from '{path}'" if _in(loaded, k) else f"{k}'s default" for k in rest]
    return (f"the override{'s' if len(cli) > 1 else ''} {', '.join(cli)}"
            + (f" (with {', '.join(where)})" if where else ""))


def _is_key(dotted: str) -> bool:
    """Whether ``dotted`` names a field of the config (``train.steps``), not some other dotted word."""
    model: Any = RunConfig
    for k in dotted.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or k not in model.model_fields:
            return False
        model = model.model_fields[k].annotation
    return True


def _in(data: dict, dotted: str) -> bool:
    node: Any = data
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


# (section, key, what): paths a YAML file may give relative to its own folder; "spec" = the
# file part of 'path/to/file.py:name' (a 'package.module:name' is left alone)
_PATHS = (("task", "path", "path"), ("task", "heldout_path", "path"), ("model", "path", "path"),
          ("reward", "fn", "spec"), ("reward", "extractor", "spec"), ("task", "name", "spec"),
          ("eval", "metric", "spec"), ("env", "fn", "spec"), ("env", "agent", "spec"), ("env", "tools", "specs"),
          ("warmstart", "traces", "spec"))


def _relative_to(data: dict, base: Path) -> dict:
    """``data`` (a YAML file's mapping) with its relative paths resolved against ``base``, the
    file's folder. Command-line overrides, applied after, stay relative to the working directory."""
    for section, key, what in _PATHS:
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if what == "specs" and isinstance(value, list):  # (a list of specs: each as one)
            assert isinstance(node, dict)  # value came from it
            node[key] = [_spec_relative(v, base) if isinstance(v, str) else v for v in value]
            continue
        if not isinstance(value, str) or not value:
            continue
        assert isinstance(node, dict)  # value came from it
        if what == "spec":
            node[key] = _spec_relative(value, base)
        elif _relative(value):
            node[key] = str(base / value)
    return data


def _spec_relative(value: str, base: Path) -> str:
    """'path/to/file.py:name' with a relative file resolved against ``base`` (a module path as it is)."""
    target, sep, name = value.rpartition(":")
    return f"{base / target}:{name}" if sep and target.endswith(".py") and _relative(target) else value


def _relative(path: str) -> bool:
    return not (Path(path).is_absolute() or path.startswith("~"))


def _apply_override(data: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value (example: train.steps=20)")
    key, raw = item.split("=", 1)
    keys = key.strip().split(".")
    model: type[BaseModel] | None = RunConfig
    node = data
    for i, k in enumerate(keys):
        fields = model.model_fields if model is not None else {}
        if model is not None and k not in fields:
            where = ".".join(keys[:i]) or "the top level"
            close = difflib.get_close_matches(k, list(fields), n=1)
            hint = f" (did you mean '{'.'.join(keys[:i] + close)}'?)" if close else f"; known: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{key}' at {where}{hint}")
        if i == len(keys) - 1:
            try:
                node[k] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                node[k] = raw
            return
        ann = fields[k].annotation if model is not None else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if model is None:
            raise ConfigError(f"config key '{'.'.join(keys[: i + 1])}' is a value, not a section")
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key '{'.'.join(keys[: i + 1])}' must be a section")


def _describe(e: ValidationError, source: str | None) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    src = f" in {source}" if source else ""
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    if err["type"] == "extra_forbidden":
        parent: type[BaseModel] = RunConfig
        for k in err["loc"][:-1]:
            ann = parent.model_fields[str(k)].annotation
            parent = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else parent
        close = difflib.get_close_matches(str(err["loc"][-1]), list(parent.model_fields), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(parent.model_fields)}"
        return f"config error{src}: unknown key '{loc}' ({hint}){more}"
    if not err["loc"] or err["type"] == "value_error":  # a cross-field check: its message says it all
        where = f"{loc}: " if err["loc"] else ""
        return f"config error{src}: {where}{err['msg'].removeprefix('Value error, ')}{more}"
    value = err.get("input")
    fix = _field_doc(err["loc"])
    return (f"config error{src}: {loc} = {value!r}: {err['msg']}"
            + (f" ({fix})" if fix else "") + more)


def _field_doc(loc: tuple) -> str:
    model: Any = RunConfig
    info = None
    for k in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or str(k) not in model.model_fields:
            break
        info = model.model_fields[str(k)]
        model = info.annotation
    return info.description if info is not None and info.description else ""


def dump_config(cfg: RunConfig, absolute: bool = False) -> str:
    """``cfg`` as YAML; ``absolute``: relative paths made absolute (against the working directory), so
    that the file reads the same wherever it is saved (a run folder's ``config.yaml``)."""
    data = cfg.model_dump(mode="json")
    return yaml.safe_dump(_relative_to(data, Path.cwd()) if absolute else data, sort_keys=False)
