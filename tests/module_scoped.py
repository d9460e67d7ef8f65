"""Caches a test module shares between its own tests, emptied when its tests are done.

A converted layer holds dozens of fx graph modules, and fx gives every graph module a class of its
own, a subclass of ``nn.Module``. Every trace sets two attributes on ``nn.Module`` (fx patches
``__call__`` and ``__getattr__`` while it traces), at a cost that grows with the number of its
subclasses alive: conversions kept for a whole worker's session made those two attributes about
9 % of the suite's time. The suite's ``settled_heap`` fixture calls ``empty`` after each module.
"""
from __future__ import annotations

import functools

_CACHES: list[dict] = []


def cache() -> dict:
    """A dict for the module's conversions, emptied when the module's tests are done."""
    made: dict = {}
    _CACHES.append(made)
    return made


def cached(fn):
    """``fn`` memoized by its (hashable) arguments until the module's tests are done."""
    kept = cache()

    @functools.wraps(fn)
    def memoized(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in kept:
            kept[key] = fn(*args, **kwargs)
        return kept[key]
    return memoized


def empty() -> None:
    """Empty every cache made by ``cache`` and ``cached``."""
    for made in _CACHES:
        made.clear()
