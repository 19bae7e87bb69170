"""Launchers: where roles run. The only package that imports Ray.

A launcher offers ``cpus``, ``data_plane(schema)``, ``weight_store()``,
``spawn(spec, cls, *args)``, ``submit(handle, method, *args)``, ``result(fut, timeout)``
(raises ``TimeoutError``), ``call(handle, method, *args)``, ``release(obj)`` (free a worker or a service),
``dp_rendezvous(rank0, world)`` (what a data-parallel trainer's ranks join: threads or
processes) and ``shutdown()``.
"""

from __future__ import annotations


def get_launcher(name: str):
    if name == "local":
        from asyncflow.launch.local import LocalLauncher

        return LocalLauncher()
    if name == "ray":
        from asyncflow.launch.ray_launcher import RayLauncher

        return RayLauncher()
    raise ValueError(f"unknown launcher '{name}' (choose local or ray)")
