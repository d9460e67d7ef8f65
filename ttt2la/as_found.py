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

from .attribute_guard import plain_attributes
from .training_mode import evaluating


def _generator_devices() -> list[int]:
    """The CUDA devices whose generators a forward may have drawn from (none before CUDA is
    initialised: forking them would initialise it)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@contextlib.contextmanager
def buffers_kept(*models: nn.Module):
    """Every buffer of ``models`` holds on the way out of the block what it held on the way in,
    and every module's plain attributes are what they were (a forward run only to check
    something must not count as one of the model's calls, nor fill a cache the layer keeps)."""
    seen, saved, modules = set(), [], {}
    for model in models:
        for b in model.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                saved.append((b, b.detach().clone()))
        modules.update((id(m), (m, plain_attributes(m))) for m in model.modules())
    try:
        yield
    finally:
        with torch.no_grad():
            for b, before in saved:
                if b.shape == before.shape and b.dtype == before.dtype:
                    b.copy_(before)
                else:                       # resized in place by the forward
                    b.data = before
        for m, before in modules.values():
            set_plain(m, before)


#: Every module inside ``as_found`` by id: ``[module, its plain attributes as found, those its
#: traces start from]`` (``filled_caches`` may start them with its caches as constructed).
_FOUND: dict[int, list] = {}


@contextlib.contextmanager
def as_found(*models: nn.Module):
    """Every module of ``models`` in evaluation mode inside the block; on the way out, each
    module's mode, every buffer's value, its plain attributes and the random generators' states
    as they were. Anything else given is left to the checks inside, which refuse it."""
    models = tuple(m for m in models if isinstance(m, nn.Module))
    found = {}
    for model in models:
        for m in model.modules():
            if id(m) not in _FOUND:
                held = plain_attributes(m)
                found[id(m)] = [m, held, held]
    _FOUND.update(found)
    try:
        with buffers_kept(*models), torch.random.fork_rng(devices=_generator_devices()), \
                evaluating(*models):
            yield
    finally:
        for key in found:
            _FOUND.pop(key, None)


def found_attributes(module: nn.Module) -> list[tuple[nn.Module, dict]]:
    """``module`` and each submodule with its plain attributes as ``as_found`` found them (as
    they are now, outside ``as_found``)."""
    out = []
    for m in module.modules():
        entry = _FOUND.get(id(m))
        out.append((m, entry[1] if entry is not None and entry[0] is m else plain_attributes(m)))
    return out


def start_traces_from(module: nn.Module, attributes: dict) -> None:
    """Traces of a layer holding ``module`` start with its plain attributes ``attributes``."""
    entry = _FOUND.get(id(module))
    if entry is not None and entry[0] is module:
        entry[2] = attributes


@contextlib.contextmanager
def traced_as_found(module: nn.Module):
    """Inside: the plain attributes of ``module`` and its submodules those its traces start
    from (as found, or with the caches their forward fills as constructed: ``filled_caches``);
    on the way out, as they were before the block. Every trace then starts alike, whatever the
    conversion's own runs cached on the layer, and what it writes there — fake tensors — never
    stays."""
    saved = []
    for m in module.modules():
        entry = _FOUND.get(id(m))
        if entry is not None and entry[0] is m:
            saved.append((m, plain_attributes(m)))
            set_plain(m, entry[2])
    try:
        yield
    finally:
        for m, before in saved:
            set_plain(m, before)


def set_plain(module: nn.Module, values: dict) -> None:
    """``module``'s plain attributes made ``values``: others removed, these set."""
    for name in plain_attributes(module).keys() - values.keys():
        del module.__dict__[name]
    module.__dict__.update(values)


__all__ = ["as_found", "buffers_kept", "traced_as_found", "found_attributes", "start_traces_from",
           "set_plain"]
