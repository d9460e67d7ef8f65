"""Numbers the loop derives from its iteration index.

The body of iteration 1 stands for every iteration (``rollup``): a step ``1 / (i + 1)`` or a
position ``t`` the code multiplies by is a plain constant of each iteration's trace, so the
rolled body would run every chunk with iteration 1's number. Iterations 1 and 2 run the same ops;
where an arithmetic op carries another number in iteration 2 than in iteration 1 (positions,
slice bounds and sizes are not compared, only values), the loop is refused, naming the line.
"""
from __future__ import annotations

import torch

from ..analysis.op_vocabulary import op_name
from ..errors import UnsupportedTTTError
from ..ir import SRC
from .partial_chunk import other_numbers


def iteration_number(second: dict[torch.fx.Node, torch.fx.Node]) -> str:
    """How an arithmetic op of iteration 1 carries another number in iteration 2, where, or
    ``""``; ``second`` maps iteration 1's nodes to the same ops of iteration 2."""
    for node, other in second.items():
        numbers = other_numbers(node, other)
        if numbers is not None:
            (ours, theirs), src = numbers, node.meta.get(SRC)
            where = f" at {src.at()}" if src is not None else ""
            return (f"{op_name(node)} by {ours[0]:g} in iteration 1 and by {theirs[0]:g} in "
                    f"iteration 2{where}")
    return ""


def refuse_iteration_numbers(second: dict, loop_src) -> None:
    """Raise ``UnsupportedTTTError`` when the loop's iterations compute with numbers of their
    index (``iteration_number``): one body cannot stand for them."""
    found = iteration_number(second)
    if found:
        raise UnsupportedTTTError(
            f"the loop at {loop_src} computes with a number that depends on the loop index "
            f"({found}): a trace holds it as a constant of each iteration, so one body cannot "
            "run every chunk. Compute it before the loop as a tensor of one value per token "
            "(for the chunks' step sizes `1 / (i + 1)`: `rate = 1 / (torch.arange(T, "
            "device=x.device) // C + 1)`), and read it in the loop like the keys and values: "
            "the chunk's value as `rate[s:e].amax()`, a token's as `rate[t]`.")


__all__ = ["iteration_number", "refuse_iteration_numbers"]
