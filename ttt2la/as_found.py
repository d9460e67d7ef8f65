"""Converting or inspecting a model leaves it as it was found: modes, buffers, random generators.

A conversion runs the model's forward many times — traces, probes at other lengths, the checks
against the code as written. A forward that updates a buffer in place (a step counter, running
statistics) would come back advanced by every one of those runs, and a forward that draws random
numbers would move the caller's generator, so the model converted and the one it was converted
from would no longer continue where the user left them. Every entry point that runs the user's
forward on its own account runs inside ``as_found``, which evaluates as ``training_mode`` says
and puts the buffers and the generators back on the way out.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .training_mode import evaluating


def _generator_devices() -> list[int]:
    """The CUDA devices whose generators a forward may have drawn from (none before CUDA is
    initialised: forking them would initialise it)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@contextlib.contextmanager
def buffers_kept(*models: nn.Module):
    """Every buffer of ``models`` holds on the way out of the block what it held on the way in
    (a forward run only to check something must not count as one of the model's calls)."""
    seen, saved = set(), []
    for model in models:
        for b in model.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                saved.append((b, b.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for b, before in saved:
                if b.shape == before.shape and b.dtype == before.dtype:
                    b.copy_(before)
                else:                       # resized in place by the forward
                    b.data = before


@contextlib.contextmanager
def as_found(*models: nn.Module):
    """Every module of ``models`` in evaluation mode inside the block; on the way out, each
    module's mode, every buffer's value and the random generators' states as they were.
    Anything else given is left to the checks inside, which refuse it."""
    models = tuple(m for m in models if isinstance(m, nn.Module))
    with buffers_kept(*models), torch.random.fork_rng(devices=_generator_devices()), \
            evaluating(*models):
        yield


__all__ = ["as_found", "buffers_kept"]
