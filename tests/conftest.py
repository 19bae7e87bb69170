"""Test-wide settings: never touch the network, keep output readable."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model or dataset downloads, ever
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
