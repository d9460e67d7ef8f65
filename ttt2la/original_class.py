"""The user's class behind a converted layer's class.

A converted layer's class is ``Converted<cls>``, made by ``converted.converted_class`` as a
subclass of the user's ``cls`` that records it under ``ORIGINAL``. Code that reads the layer as
written — its ``forward``, its signature, its source — asks here, without importing the module
that converts (which builds on most of the package).
"""
from __future__ import annotations

#: the attribute of a ``Converted<cls>`` that holds the user's ``cls``
ORIGINAL = "_ttt2la_original"


def original_class(cls: type) -> type:
    """The user's class a ``Converted<cls>`` was made from (``cls`` itself otherwise)."""
    return cls.__dict__.get(ORIGINAL, cls)


__all__ = ["ORIGINAL", "original_class"]
