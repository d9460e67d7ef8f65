"""Numbers of the loop body that depend on how many tokens a chunk holds.

A partial last chunk runs the body padded with zero tokens to the full chunk. Padding is inert
for sums over the chunk's tokens, and ``padding_problem`` probes the body for the terms it moves
(a mean in the forward pass, attention across the tokens). One kind it cannot see: a number the
code derives from the chunk's length, such as the ``1 / (C·D)`` in the gradient of a mean loss
(``F.mse_loss``, ``.mean()`` under ``torch.func.grad``). The traced body holds it as a constant,
so no probe of the body moves it, yet the code as written divides a partial chunk of ``r`` tokens
by ``r·D``. The trace shows it: the probe length leaves the loop's last iteration partial, and
there the same arithmetic op carries another number than in a whole chunk.
"""
from __future__ import annotations

import torch

from ..analysis.op_vocabulary import ARITHMETIC, AVERAGES, op_name
from ..ir import SRC


def _numbers(node: torch.fx.Node) -> list:
    return [a for a in (*node.args, *node.kwargs.values())
            if isinstance(a, (int, float)) and not isinstance(a, bool)]


def other_numbers(node: torch.fx.Node, other: torch.fx.Node) -> tuple[list, list] | None:
    """``(node's numbers, other's)`` when the arithmetic op ``node`` carries other numbers than
    the same op ``other`` of another iteration (positions and sizes aside), else ``None``."""
    if node.op != "call_function" or op_name(node) not in ARITHMETIC:
        return None
    ours, theirs = _numbers(node), _numbers(other)
    return (ours, theirs) if ours != theirs and len(ours) == len(theirs) else None


def _reduced_sizes(node: torch.fx.Node) -> tuple | None:
    """The sizes a mean (or variance) reduces over, or ``None`` for other ops."""
    if node.op != "call_function" or op_name(node) not in AVERAGES:
        return None
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dims = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) \
        else range(val.dim())
    return tuple(int(val.shape[d]) for d in dims)


def _differs(node: torch.fx.Node, last: torch.fx.Node) -> str:
    """How ``node`` (a whole chunk's op) differs from ``last`` (the same op of the partial
    iteration the probe length leaves), or ``""``. Only the whole chunk's number is named: the
    partial one is the probe's, and the text is kept and shown for calls whose partial chunk
    holds another number of tokens, where the probe's number would be wrong."""
    if node.op != "call_function":
        return ""
    name = op_name(node)
    numbers = other_numbers(node, last)
    if numbers is not None:
        return f"{name} by {numbers[0][0]:g} in a whole chunk, by another number in a partial one"
    ours, theirs = _reduced_sizes(node), _reduced_sizes(last)
    if ours is not None and ours != theirs:
        return f"a {name} over {ours} elements in a whole chunk, over fewer in a partial one"
    return ""


def length_dependent_number(whole: dict[torch.fx.Node, torch.fx.Node]) -> str:
    """What the partial last iteration computes with another number than a whole chunk, or ``""``.

    ``whole`` maps a whole chunk's nodes (iteration 1) to the same ops of the loop's last
    iteration, which the probe length leaves partial.
    """
    for node, last in whole.items():
        found = _differs(node, last)
        if found:
            where = node.meta.get(SRC)
            return (f"a number the code derives from the chunk's length ({found}"
                    f"{f' at {where}' if where else ''}: a mean's divisor, say)")
    return ""


__all__ = ["length_dependent_number", "other_numbers"]
