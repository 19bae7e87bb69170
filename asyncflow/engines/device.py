"""Where the built-in engines compute: ``resources.device`` (``cpu``, ``cuda``, ``cuda:N``).

Design: a model is moved to its device once, when a worker builds it; every engine then
takes its device from the model's parameters (``model_device``), creates its own tensors
there, and hands numpy (host) arrays back. Host-side bookkeeping (token lists, rewards,
the data plane, the weight store) never leaves the CPU, so the weights travel as numpy
buffers whatever the device, and a CPU run and a GPU run share one code path.

On Ray each compute role asks for its share of the GPUs, and Ray points the process's
``CUDA_VISIBLE_DEVICES`` at the one it got: ``cuda`` is then that GPU.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``name`` as a torch device, or a one-line error that says how to fix it."""
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"resources.device={name}, but torch {torch.__version__} sees no CUDA GPU in this "
                             f"process: set resources.device=cpu, or install a CUDA build of torch on a GPU machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"resources.device={name}, but this process sees {torch.cuda.device_count()} CUDA "
                             f"GPU(s): use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return dev


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
