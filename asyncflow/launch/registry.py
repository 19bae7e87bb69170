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

        return RayLauncher()
    raise ValueError(f"unknown launcher '{name}' (choose local or ray)")
