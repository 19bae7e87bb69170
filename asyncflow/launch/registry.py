"""Launchers by name: ``local`` (threads of this process) or ``ray`` (Ray actors).

What a launcher offers is declared once, in :class:`~asyncflow.workflow.launcher.Launcher`.
"""

from __future__ import annotations

from asyncflow.launch.local import LocalLauncher
from asyncflow.workflow.launcher import Launcher


def get_launcher(name: str) -> Launcher:
    if name == "local":
        return LocalLauncher()
    if name == "ray":
        from asyncflow.launch.ray_launcher import RayLauncher  # lazy: ray, optional until launcher=ray

        # TODO(merge): Launcher declares cpus/gpus/owns_host as settable attributes; RayLauncher's
        # are read-only properties (read-only protocol members in workflow/launcher.py fix it)
        return RayLauncher()  # type: ignore[return-value]
    raise ValueError(f"unknown launcher '{name}' (choose local or ray)")
