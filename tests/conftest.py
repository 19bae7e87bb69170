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


_BEFORE = _present()
_HOME = tempfile.mkdtemp(prefix="asyncflow-test-home-")  # (under /tmp: excluded from the check, removed below)
os.environ["HOME"] = _HOME
os.environ["XDG_CACHE_HOME"] = os.path.join(_HOME, ".cache")


def pytest_sessionfinish(session, exitstatus):
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
