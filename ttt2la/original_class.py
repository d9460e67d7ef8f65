"""The user's class behind a converted layer's class.

A converted layer's class is ``Converted<cls>``, made by ``converted.converted_class`` as a
subclass of the user's ``cls`` that records it under ``ORIGINAL``. A class made on top of it
after conversion — ``torch.nn.utils.parametrize`` makes ``Parametrized<Converted<cls>>`` when a
parametrization is registered on the converted layer's own parameter — still has it in its
MRO. Code that reads the layer as written — its ``forward``, its signature, its source — asks
here, without importing the module that converts (which builds on most of the package).
"""
from __future__ import annotations

import functools

#: the attribute of a ``Converted<cls>`` that holds the user's ``cls``
ORIGINAL = "_ttt2la_original"

#: ``written_class`` by the class it was made for
_WRITTEN: dict[type, type] = {}


def _converted_in(cls: type) -> type | None:
    """The ``Converted<cls>`` in ``cls``'s MRO (``None`` when there is none)."""
    return next((k for k in cls.__mro__ if ORIGINAL in k.__dict__), None)


def original_class(cls: type) -> type:
    """The user's class a ``Converted<cls>`` was made from, wherever that sits in ``cls``'s
    MRO (``cls`` itself when it is no converted layer's class)."""
    converted = _converted_in(cls)
    return cls if converted is None else converted.__dict__[ORIGINAL]


def written_class(cls: type) -> type:
    """``cls`` without its ``Converted<cls>``: the user's class, or the classes made on top of
    the converted one after conversion (a parametrization's, with its properties) made again
    on top of the user's class — a module of it runs the code as written on the same
    attributes."""
    converted = _converted_in(cls)
    if converted is None:
        return cls
    above = cls.__mro__[:cls.__mro__.index(converted)]
    if not above:
        return converted.__dict__[ORIGINAL]
    if cls not in _WRITTEN:
        base = converted.__dict__[ORIGINAL]
        for k in reversed(above):
            own = {n: v for n, v in k.__dict__.items() if n not in ("__dict__", "__weakref__")}
            base = type(k.__name__.replace(converted.__name__, base.__name__), (base,), own)
        _WRITTEN[cls] = base
    return _WRITTEN[cls]


def _forward_as_written(module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` by the user's own ``forward``."""
    return original_class(type(module)).forward(module, *args, **kwargs)


def written_call(module, args: tuple, kwargs: dict):
    """A call of ``module(*args, **kwargs)`` by the user's own ``forward``, to run later (where
    a converted layer runs its code as written instead of its plan): a ``partial``, which
    TorchDynamo hands as it is to a call it runs between graphs."""
    return functools.partial(_forward_as_written, module, args, kwargs)


__all__ = ["ORIGINAL", "original_class", "written_call", "written_class"]
