"""``torch.func.vmap`` over a flat list of tensors, without its per-call Python.

A plan batches a feature graph over the chunk axis on every call. ``torch.func.vmap`` spends
most of a short call's batching outside the graph: it flattens the arguments and the in-dims as
pytrees, checks them one by one, then flattens the outputs again (about 70 µs of a 90 µs call
batching three ops over 4 chunks). The plans' feature graphs take a flat tuple of tensors and
return a flat tuple of tensors, with in-dims 0 or ``None`` fixed when the plan was built, so
``flat_vmap`` runs the same functorch level (``_vmap_increment_nesting``, ``_add_batch_dim``,
``_remove_batch_dim``, as ``vmap`` itself does) with only what can differ between calls
checked: that every batched input has the same chunk count, and that the outputs are tensors.
The ops dispatched, and so the values, are ``vmap``'s. Under a compiler, which traces ``vmap``
as one operator, the public ``vmap`` runs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch._C._functorch import (_add_batch_dim, _remove_batch_dim, _vmap_decrement_nesting,
                                 _vmap_increment_nesting)
from torch.func import vmap


def flat_vmap(fn: Callable, in_dims: Sequence[int | None], args: Sequence) -> tuple:
    """``vmap(fn, in_dims=tuple(in_dims))(*args)`` for a ``fn`` taking and returning flat
    tuples of tensors, batched over axis 0 where ``in_dims`` says 0 (``None``: unbatched);
    outputs batched on axis 0, an output that does not depend on the batched inputs expanded
    over it, as ``vmap`` does."""
    if torch.compiler.is_compiling() or any(d not in (0, None) for d in in_dims):
        return tuple(vmap(fn, in_dims=tuple(in_dims))(*args))
    sizes = {a.shape[0] for a, d in zip(args, in_dims) if d == 0}
    if len(sizes) != 1:
        raise ValueError(f"flat_vmap: the batched inputs must share one size along axis 0, got "
                         f"{sorted(sizes) or 'no batched input'}")
    (n,) = sizes
    level = _vmap_increment_nesting(n, "error")
    try:
        outs = fn(*[a if d is None else _add_batch_dim(a, 0, level)
                    for a, d in zip(args, in_dims)])
        if not isinstance(outs, (tuple, list)) or \
                not all(isinstance(o, torch.Tensor) for o in outs):
            raise ValueError("flat_vmap: the function must return a tuple of tensors, got "
                             f"{type(outs).__name__}")
        return tuple(_remove_batch_dim(o, level, n, 0) for o in outs)
    finally:
        _vmap_decrement_nesting()


__all__ = ["flat_vmap"]
