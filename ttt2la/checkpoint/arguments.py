"""Checks of what a caller hands ``save`` and ``load``, made before any file is read or written,
so that an argument of the wrong type is answered with an ``InvalidInputError`` saying what was
found and what is expected."""
from __future__ import annotations

import json
import os

from pathlib import Path

import torch

from ..validation import InvalidInputError, check_argument_types


def as_directory(value, name: str = "directory") -> Path:
    """``value`` as a path: a ``str`` or ``os.PathLike``, nothing else (``None`` or a number
    would otherwise fail deep inside ``pathlib``)."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidInputError(f"{name} must be a path (a str or pathlib.Path), got "
                                f"{'None' if value is None else type(value).__name__}")
    return Path(value)


def factory_spec(factory) -> str | None:
    """The ``"pkg.module:qualname"`` a manifest records for ``factory``: given as such, or a
    callable that can be imported back under its own name (a lambda or a local function cannot,
    so ``load`` could not call it)."""
    if factory is None or isinstance(factory, str):
        return factory
    if not callable(factory):
        raise InvalidInputError(f"factory must be \"pkg.module:function\" or an importable "
                                f"callable, got {type(factory).__name__}")
    from .recipe import resolve_factory

    spec = f"{_module_of(factory)}:{getattr(factory, '__qualname__', None)}"
    try:
        found = resolve_factory(spec, "factory")
    except Exception:
        found = None
    if found is not factory:
        raise InvalidInputError(f"factory {factory!r}: cannot be imported back as {spec}, so "
                                "load could not call it; pass a module-level function or class, "
                                "or its name as \"pkg.module:function\"")
    return spec


def _module_of(factory) -> str | None:
    """The module a factory is recorded under: the bundled models' own (so ``load`` calls them
    without an opt-in) when they export it, else the one that defines it."""
    import importlib

    from .trust import BUNDLED_MODULE

    name = getattr(factory, "__qualname__", None)
    if isinstance(name, str) and getattr(importlib.import_module(BUNDLED_MODULE), name, None) is factory:
        return BUNDLED_MODULE
    return getattr(factory, "__module__", None)


def check_config(config) -> dict:
    """``config``: None or a dict of keyword arguments that JSON can record."""
    if config is None:
        return {}
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise InvalidInputError(f"config must be a dict of the factory's keyword arguments, got "
                                f"{type(config).__name__}")
    try:
        json.dumps(config, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"config {config!r}: cannot be recorded as JSON ({e}); pass "
                                "plain numbers, strings, lists and dicts") from e
    return dict(config)


def example_arguments(example_inputs, example_kwargs) -> tuple[tuple, dict | None]:
    """``(args, kwargs)`` of the example inputs, refusing anything but tensors (the only inputs
    a checkpoint stores)."""
    check_argument_types(example_inputs, example_kwargs)
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else \
        tuple(example_inputs or ())
    named = {f"#{i}": a for i, a in enumerate(args)} | dict(example_kwargs or {})
    bad = [f"{k} ({type(v).__name__})" for k, v in named.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise InvalidInputError(f"save stores tensor example inputs only; {', '.join(bad)} "
                                f"{'is not a tensor' if len(bad) == 1 else 'are not tensors'}")
    return args, example_kwargs or None


__all__ = ["as_directory", "factory_spec", "check_config", "example_arguments"]
