"""A dataclass a layer takes or returns, carried by ``pytree`` as a container of its fields.

``pytree`` flattens tuples, lists, dicts and named tuples; a dataclass of the user's
(``Batch(x, mask)`` in, ``Output(y, state)`` out) is a leaf to it until its class is registered.
A trace then fails on such an output as if the loop had not run, and a layer taking one "takes no
tensor input". ``carry_dataclasses`` registers each dataclass a value holds, as ``torch.export``
asks users to (``torch.export.register_dataclass``): its fields become inputs and outputs, and a
converted call unflattens them into the same class.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree


def carry_dataclasses(tree) -> None:
    """Register each dataclass ``tree`` holds that ``pytree`` does not know yet (nested ones too;
    a class it cannot take is left a leaf, whose trace then says what failed)."""
    for _ in range(8):                  # a dataclass inside another's field: one level a round
        found = {type(v) for v in pytree.tree_leaves(tree)
                 if dataclasses.is_dataclass(v) and not isinstance(v, type)}
        if not found:
            return
        for cls in found:
            try:
                torch.export.register_dataclass(cls)
            except Exception:
                return


__all__ = ["carry_dataclasses"]
