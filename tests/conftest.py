"""Test-wide settings: never touch the network, keep output readable."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model or dataset downloads, ever
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
