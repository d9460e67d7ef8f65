"""Scans along the sequence inside one step: TTT code written in sequence-parallel form.

titans-pytorch computes every chunk's gradient at once and then runs momentum and decay over the
chunks as a scan (a prefix sum, or an associative scan of shifted copies:
``cat([ones, a[:, :-s]])``). Traced, that is a single step whose update runs along an axis in
order; what a loop would carry from chunk to chunk is an op inside the step, not a state, so the
passes that remove per-chunk state (momentum) cannot see it and say so instead of calling the
step already simplified.
"""
from __future__ import annotations

import torch.fx

from ..ir import TTTProgram
from .op_vocabulary import RUNNING_OPS, SLICES, calls, op_name

_SHIFT_JOINS = frozenset({"cat", "constant_pad_nd", "pad"})


def scans_within(program: TTTProgram) -> list[torch.fx.Node]:
    """The ops on the path to the states' new values that run along an axis in order: running
    ops (``cumsum``, ``cumprod``, ``roll`` ...) and shifts (a slice of a value joined or padded
    back to that value's size along the same axis)."""
    seen, stack, found = set(), list(program.state_outputs()), []
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        if calls(node, RUNNING_OPS) or _is_shift(node):
            found.append(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(program.body.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _is_shift(node: torch.fx.Node) -> bool:
    """Whether ``node`` joins or pads a slice of a value back to that value's size along the
    sliced axis: ``cat([fill, x[:, :-s]], 1)``, ``F.pad(x[:, 1:], (0, 0, 0, 1))``."""
    if not calls(node, _SHIFT_JOINS):
        return False
    out = _shape(node)
    parts = node.args[0] if op_name(node) == "cat" else [node.args[0]]
    for part in parts:
        if not calls(part, SLICES) or out is None:
            continue
        whole, piece = _shape(part.args[0]), _shape(part)
        if whole is None or piece is None or len(whole) != len(out):
            continue
        axis = _slice_axis(part) % len(out)
        if whole[axis] == out[axis] > piece[axis] and whole[:axis] == out[:axis]:
            return True
    return False


def _slice_axis(node: torch.fx.Node) -> int:
    """The axis a ``slice``/``narrow`` node cuts."""
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if hasattr(val, "shape") else None


__all__ = ["scans_within"]
