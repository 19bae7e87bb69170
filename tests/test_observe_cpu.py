"""CPU accounting of a run (cores the machine used, per worker process, the rest) and the
allocator setting every worker makes (no page faults per step)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncflow.observe.report import busy_cpu_seconds, cpu_use, machine_cpu_s, on_cpu


def test_cpu_use_counts_each_process_once_and_the_rest_as_other():
    before = {"rollout": {"cpu_s": 10.0, "pid": 1}, "actor": {"cpu_s": 4.0, "pid": 2},
              "reference": {"cpu_s": 4.0, "pid": 2}}  # actor and reference share process 2
    after = {"rollout": {"cpu_s": 13.0, "pid": 1}, "actor": {"cpu_s": 8.0, "pid": 2},
             "reference": {"cpu_s": 8.0, "pid": 2}}
    got = cpu_use(before, after, (100.0, 109.0), wall=5.0)
    # rollout 3 s / 5 s, process 2 (4 s, once) / 5 s; machine 9 s / 5 s
    assert got["roles"] == pytest.approx({"rollout": 0.6, "actor+reference": 0.8})
    assert got["cores"] == pytest.approx(1.8) and got["other"] == pytest.approx(0.4)


def test_cpu_use_without_proc_stat_reports_no_machine_figures():
    got = cpu_use({"actor": {"cpu_s": 1.0, "pid": 1}}, {"actor": {"cpu_s": 2.0, "pid": 1}}, (None, None), 2.0)
    assert got == {"cores": None, "roles": {"actor": 0.5}, "other": None}


def test_machine_cpu_grows_with_work():
    a = machine_cpu_s()
    if a is None:
        pytest.skip("no /proc/stat here")
    x = 0
    for i in range(2_000_000):  # ~0.1 s of CPU
        x += i
    assert machine_cpu_s() > a


def test_on_cpu_is_cpu_over_wall_of_the_compute_sections_between_snapshots():
    before = {"actor": {"busy_s": 1.0, "busy_cpu_s": 0.9}, "rollout": {"busy_s": 2.0, "busy_cpu_s": 2.0}}
    after = {"actor": {"busy_s": 5.0, "busy_cpu_s": 4.5}, "rollout": {"busy_s": 2.0, "busy_cpu_s": 2.0},
             "reward": {"busy_s": 1.0}}  # a role without CPU accounting is left out
    # actor: (4.5 - 0.9) / (5 - 1) = 0.9; rollout computed nothing in the window: left out
    assert on_cpu(before, after) == pytest.approx({"actor": 0.9})
    assert busy_cpu_seconds(before, after) == pytest.approx({"actor": 3.6, "rollout": 0.0})


def test_a_role_counts_the_cpu_its_thread_got_in_its_compute_sections():
    import time

    from asyncflow.workflow.roles.base import Role

    role = Role()
    with role.work():
        time.sleep(0.2)  # computing nothing: wall, no CPU
    assert role.busy_s >= 0.2 and role.busy_cpu_s < 0.05
    with role.work():
        t = time.thread_time()
        while time.thread_time() - t < 0.1:  # computing: CPU
            pass
    assert role.busy_cpu_s >= 0.1 and role.busy_cpu_s <= role.busy_s
    assert role.stats()["busy_cpu_s"] == role.busy_cpu_s


FAULTS = """
import resource, sys
import numpy as np
from asyncflow.engines.allocator import keep_heap
print(keep_heap(), file=sys.stderr)
for i in range(3):  # a step's activations: allocated, touched, freed
    a = np.ones(64 << 20, dtype=np.uint8); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(10):
    a = np.ones(64 << 20, dtype=np.uint8); del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
@pytest.mark.parametrize("keep", ["1", "0"])
def test_keep_heap_stops_the_page_faults_of_repeated_steps(keep):
    out = subprocess.run([sys.executable, "-c", FAULTS], env={"ASYNCFLOW_KEEP_HEAP": keep, "PATH": ""},
                         capture_output=True, text=True, check=True)
    faults, took = int(out.stdout), out.stderr.strip()
    if keep == "1":
        assert took == "True" and faults < 32  # the 64 MiB block is reused from the heap
    else:  # above glibc's largest dynamic mmap threshold (32 MiB): mapped and unmapped each
        # time, at least one fault per 2 MiB (transparent huge pages) or per 4 KiB page
        assert took == "False" and faults >= 10 * 32
