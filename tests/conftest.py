"""Test-wide settings: never touch the network, keep output readable, leave nothing behind.

The suite runs with ``HOME`` (and the XDG cache folder) pointed at a folder of its own, removed
at the end: the warm-start cache (``~/.cache/asyncflow``), Ray's and matplotlib's files land
there, never in the user's home; tests that share the default warm-start still share it within
the run. At the end, any new ``/tmp/asyncflow*`` entry, new ``/dev/shm/afdp-*`` segment or
new entry in the real ``~/.cache`` fails the run, naming them.
"""

import glob
import os
import pathlib
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model or dataset downloads, ever
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_REAL_CACHE = pathlib.Path(os.path.expanduser("~/.cache"))
_WATCHED = ("/tmp/asyncflow*", "/dev/shm/afdp-*")


def _present() -> set[str]:
    found = {p for pattern in _WATCHED for p in glob.glob(pattern)}
    return found | ({str(p) for p in _REAL_CACHE.iterdir()} if _REAL_CACHE.is_dir() else set())


# pytest-xdist: a worker shares the HOME its controller made (one warm-start cache for the run;
# entries are published with os.replace, so two workers writing one key is safe); the controller
# removes it and checks for leftovers once every worker is done.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_BEFORE = _present()
if _WORKER and os.environ.get("ASYNCFLOW_TEST_HOME"):
    _HOME = os.environ["ASYNCFLOW_TEST_HOME"]
else:
    _HOME = tempfile.mkdtemp(prefix="asyncflow-test-home-")  # (under /tmp: excluded from the check, removed below)
    os.environ["ASYNCFLOW_TEST_HOME"] = _HOME
os.environ["HOME"] = _HOME
os.environ["XDG_CACHE_HOME"] = os.path.join(_HOME, ".cache")
if _WORKER:  # two workers on two cores: one torch thread each (the project's rule for processes side by side)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionfinish(session, exitstatus):
    if _WORKER:
        return
    shutil.rmtree(_HOME, ignore_errors=True)
    left = sorted(_present() - _BEFORE - {_HOME})
    if left and os.environ.get("ASYNCFLOW_ALLOW_LEFTOVERS") != "1":  # (a machine shared with other jobs)
        print(f"\nthe test run left files behind (tests must write under tmp_path only): {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")])])
def device(request):
    """A test taking ``device`` runs on the CPU and, where there is one, on a CUDA GPU
    (``resources.device=cuda``)."""
    return request.param


@pytest.fixture
def model_dir(tmp_path):
    """A tiny random model + the char tokenizer saved with ``save_pretrained`` (a model.path)."""
    from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadfile``, the README's command) files are handed to the
    workers in collection order as they free up: the files with end-to-end runs (a test marked
    ``slow`` or ``ray``) go first, so the long ones start early and the short ones fill the gaps
    (longest first). A plain ``pytest`` keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    heavy = {it.path for it in items if it.get_closest_marker("slow") or it.get_closest_marker("ray")}
    items.sort(key=lambda it: it.path not in heavy)  # (stable: a file's own tests keep their order)
