"""Plain Python objects a layer holds as configuration, compared by their fields.

A layer often keeps its settings in an object of their own — a dataclass, a
``types.SimpleNamespace``, an instance of a small class of the user's — and reads
``self.cfg.scale`` in its code. A trace bakes the field's value into its graphs, so setting
``layer.cfg.scale`` after conversion must be seen; but such an object compares by identity
(a class without ``__eq__``, a dataclass with ``eq=False``), and the guard holds the very object
the layer does. ``Fields`` keeps the object's class and its fields as they were (each as the
guard keeps it, ``attribute_guard.comparable``) and equals the object while neither changed.
"""
from __future__ import annotations

import types

import torch


def plain_object(value) -> bool:
    """Whether ``value`` is an object of the user's settings: one with a ``__dict__`` that is no
    function, class, module, tensor or ``nn.Module`` (its fields are judged by the caller)."""
    return _has_dict(value) and not callable(value) and not isinstance(
        value, (type, types.ModuleType, torch.Tensor, torch.nn.Module))


def _has_dict(value) -> bool:
    """Whether ``value`` has a ``__dict__``, asked without its ``__getattr__`` (which may raise
    anything for a name it does not know)."""
    try:
        object.__getattribute__(value, "__dict__")
    except AttributeError:
        return False
    return True


class Fields:
    """An object's class and its fields when it was recorded: equal to the object (or to
    another ``Fields``) while both are the same."""

    __hash__ = None     # type: ignore[assignment]

    def __init__(self, value, kept: dict):
        self.kind, self.fields = type(value), kept

    def __eq__(self, other) -> bool:
        if isinstance(other, Fields):
            return self.kind is other.kind and self.fields == other.fields
        if type(other) is not self.kind or not _has_dict(other):
            return False
        now = vars(other)
        return now.keys() == self.fields.keys() and all(
            _same(now[k], v) for k, v in self.fields.items())

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{self.kind.__name__}({shown})"


def _same(now, then) -> bool:
    """A field now against its recorded value (``then == now`` first: a recorded ``Fields``
    compares a nested object by its fields)."""
    if now is then:
        return True
    try:
        return bool(then == now)
    except Exception:
        return False


__all__ = ["Fields", "plain_object"]
