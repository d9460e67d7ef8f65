"""Helpers a layer's code calls from another file of the user's: the run that follows the
call's sizes patches every module of the user's, not the loop's alone."""
import math


def grow(outs: list, y) -> list:
    """Append ``y`` to ``outs`` (the loop's own source appends nothing by name)."""
    outs.append(y)
    return outs


def whole_root(n: int) -> bool:
    """Is ``n`` a perfect square? (A decision on a value of the length, through ``math``.)"""
    return math.sqrt(n) % 1 == 0


def chunk_count(x) -> int:
    """The number of chunks of 4 tokens of ``x``, through ``range`` and ``len`` as this file sees
    them (``x.size(dim=1)``: no source reading follows it, the run alone counts it)."""
    return len(range(0, x.size(dim=1), 4))
