"""The length of a layer's sequence, read off the axis its loop walks.

The example's length is taken from axis 1 of its first input (``[B, L, D]``). That guess is
wrong for a layer whose input is laid out heads first (``[B, H, L, D]``, as many published
kernels take q, k and v) or whose first argument is no sequence at all (an initial fast weight
``[B, D, D]``, a gate ``[B, 1]``): axis 1 then holds the heads or a feature size, and a layer
traced with that axis as its tokens runs the wrong function. Discovery saw which stretch the
loop's chunks were cut from (``LoopCandidate.slice_lengths``); where that is not the guessed
length, the input axis of the sliced length is the token axis — once an eager run confirms it:
the layer stretched along that axis slices the longer stretch.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .discover import LoopCandidate, _discover_once


def sliced_length(cand: LoopCandidate, flat: list, in_spec, guessed: int | None) -> int | None:
    """The sequence length the loop of ``cand`` slices, where it differs from ``guessed`` (the
    example's axis 1) and an input axis holds it; else ``guessed``, unchanged."""
    if guessed is None or cand.cuts_only or cand.probe_length is not None \
            or not cand.slice_lengths or guessed in cand.slice_lengths:
        return guessed
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 1]
    for n in sorted(cand.slice_lengths, reverse=True):
        if n > 1 and any(n in x.shape[1:] for x in tensors) and _walks(cand, flat, in_spec, n):
            return n
    return guessed


def _walks(cand: LoopCandidate, flat: list, in_spec, n: int) -> bool:
    """Whether the loop slices ``2n`` tokens once every input axis of size ``n`` is doubled: the
    axis holds the sequence the loop walks, not a feature or head size that happens to match."""
    longer = []
    for x in flat:
        if isinstance(x, torch.Tensor) and x.dim() > 1 and n in x.shape[1:]:
            axis = 1 + list(x.shape[1:]).index(n)
            x = torch.cat([x, x], dim=axis)
        longer.append(x)
    args, kwargs = pytree.tree_unflatten(longer, in_spec)
    try:
        found = _discover_once(cand.module, tuple(args), kwargs)[0]
    except Exception:           # the layer does not run so: that axis is not its sequence
        return False
    return any(c.path == "" and c.loop == cand.loop and 2 * n in c.slice_lengths
               for c in found)
