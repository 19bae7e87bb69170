"""Loading a user's code by import path: ``package.module:name`` or ``path/to/file.py:name``.

Used for ``reward.fn`` and for ``task.name`` when it names a user's task factory. A file
path is imported as a module of its own (its folder is not put on ``sys.path``); a module
path is imported normally (it must be installed or on ``PYTHONPATH``). Every failure is one
:class:`~asyncflow.config.ConfigError` line naming the config key, the path and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.config import ConfigError
from asyncflow.config.files import missing_code_file


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable named by ``spec`` (``module:name`` or ``file.py:name``); ``what`` names the config key."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"{what} = '{spec}': expected 'package.module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        module = _import_file(Path(target).expanduser(), spec, what)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"{what} = '{spec}': cannot import module '{target}' ({e}); is it installed or on "
                              "PYTHONPATH? (or give a file: 'path/to/file.py:function')") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{what} = '{spec}': '{target}' has no function '{name}'")
    return fn


def _import_file(path: Path, spec: str, what: str) -> Any:
    if not path.is_file():
        raise ConfigError(missing_code_file(what, spec, path))
    key = "asyncflow_user_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    loader_spec = importlib.util.spec_from_file_location(key, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"{what} = '{spec}': '{path}' cannot be imported as a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[key] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[key]
        raise ConfigError(f"{what} = '{spec}': importing '{path}' failed: {type(e).__name__}: {e}") from None
    return module
