"""The sizes of a reshape or view as values of the call's sizes, its ``-1`` included.

``x.reshape(B, -1, C, D).shape[1]`` is the number of chunks, ``L / C``: no multiple of the
run's length ``L*``, so the run's reading of sizes (``_Tracking._sizes``: a size that is a
multiple of ``L*`` or ``B*`` is one of them) hands it out as a plain ``int`` and a decision on
it converts with the run's branch at every length. ``shaped(args, kwargs, dims)`` computes each
size of the output as a function of the sizes: a number given is its own (a ``SizeInt``'s or a
constant), and the inferred one is the input's number of elements over the product of the
others, rounded up — exact where the axis divides, and where it does not, the count of the
padded chunks the code views the sequence as (``pad = (-T) % C`` makes the axis ``L*`` at the
run's length, a whole number of chunks).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .size_uses import SizeInt, _at

#: what views a tensor with the sizes given after it (``Tensor.view(dtype)`` is left out)
RESHAPES = frozenset({torch._C.TensorBase.reshape, torch._C.TensorBase.view, torch.reshape})


def _requested(args, kwargs) -> list | None:
    """The sizes asked for: ``reshape(B, -1, C)``, ``reshape((B, -1, C))``, ``shape=``."""
    rest = list(args[1:])
    if "shape" in kwargs:
        rest = [kwargs["shape"]]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = list(rest[0])
    if not rest or any(isinstance(n, bool) or not isinstance(n, int) for n in rest):
        return None
    return rest


def shaped(args, kwargs, dims: list[Callable | None]) -> list[Callable | None] | None:
    """Each size of a reshape's output as a function of the sizes (``None``: a constant), where
    one of them is a value of the sizes; ``None`` where none is, or the shape is no list of
    numbers. ``dims``: the input's sizes so (``None``: a constant)."""
    shape = _requested(args, kwargs)
    if shape is None:
        return None
    given = [n.at if isinstance(n, SizeInt) else None for n in shape]
    free = [i for i, n in enumerate(shape) if not isinstance(n, SizeInt) and n == -1]
    if len(free) > 1 or all(f is None for f in given) and all(d is None for d in dims):
        return None
    if free:
        numel = [d or _at(n) for d, n in zip(dims, args[0].shape)]
        others = [_at(n) for i, n in enumerate(shape) if i != free[0]]

        def inferred(L, B):
            whole = math.prod(f(L, B) for f in numel)
            return -(-whole // math.prod(f(L, B) for f in others))
        given[free[0]] = inferred
    return None if all(f is None for f in given) else given


__all__ = ["RESHAPES", "shaped"]
