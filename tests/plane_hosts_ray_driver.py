"""A Ray driver run in namespace A by tests/test_dataplane_hosts.py: ``RayLauncher``
joins the two-node cluster at ``$RAY_ADDRESS`` and takes ``resources.data_plane=auto``.
Prints one JSON line (node addresses, the plane's kind, unit endpoints, transports, data
equal)."""

from __future__ import annotations

import json
import time

import numpy as np
import ray

from asyncflow.dataplane import Field, Schema
from asyncflow.launch.ray_launcher import RayLauncher


def main() -> None:
    t0 = time.monotonic()
    launcher = RayLauncher()
    schema = Schema([Field("x", "float32", (4,)), Field("wide", "float32", (128 * 1024,))])
    plane = launcher.data_plane(schema, "auto", 2)
    out = {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")),
           "kind": type(plane).__name__, "one_host": launcher.one_host()}
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    wide = np.random.default_rng(0).standard_normal((8, 128 * 1024)).astype(np.float32)  # 4 MiB: over shm's threshold
    plane.put({"x": x, "wide": wide})
    meta, data = plane.get_batch("t", ["x", "wide"], n=8, timeout=20)
    order = np.argsort(meta.rows)
    out.update(units=plane.storage_endpoints(), transports=plane.transports(),
               equal=bool(np.array_equal(np.asarray(data["x"])[order], x)
                          and np.array_equal(np.asarray(data["wide"])[order], wide)))
    launcher.shutdown()
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
