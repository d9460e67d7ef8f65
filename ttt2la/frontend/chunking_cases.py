"""The cases a chunked plan tells lengths apart by itself, and decisions of the code that are one.

A plan over chunks of ``C`` tokens runs, at any length ``L``, ``L // C`` whole chunks (none
included) and a partial last chunk of ``L % C`` tokens where that is not zero. Code written as a
scan over pre-chunked mini-batches makes the same two cases Python decisions around its loop
(``n, rest = divmod(L, K)``, ``if n > 0:`` the scan over whole mini-batches, ``if rest > 0:``
the call for the remaining tokens), which the recogniser reads as one loop with a partial last
chunk. A decision whose outcome at every length *is* one of these cases (or its negation) tells
apart only lengths the plan tells apart too; ``chunking_decisions`` then checks that the plan
computes the code's function in every combination of them before it stops holding lengths for
them.
"""
from __future__ import annotations

from typing import Callable

#: the plan's cases, by name: whether length ``L`` holds a whole chunk of ``C`` tokens, and
#: whether its last chunk is partial
CASES: dict[str, Callable[[int, int], bool]] = {
    "a whole chunk": lambda L, C: L >= C,
    "a partial last chunk": lambda L, C: L % C != 0,
}


def chunking_case(outcome: Callable[[int], object], chunk: int, lengths: list[int]) -> str:
    """The case (a name of ``CASES``) whose truth, or its negation's, is the decision
    ``outcome(L)`` (a ``bool``) at every one of ``lengths``; ``""`` for none (or a chunk of one
    token, whose plan has no partial chunk)."""
    if chunk < 2:
        return ""
    try:
        values = [outcome(L) for L in lengths]
    except Exception:
        return ""
    if not all(isinstance(v, bool) for v in values):
        return ""
    for name, case in CASES.items():
        truth = [case(L, chunk) for L in lengths]
        if values == truth or values == [not t for t in truth]:
            return name
    return ""


def case_lengths(cases: set[str], chunk: int, per_case: int = 2) -> list[int]:
    """``per_case`` of the shortest lengths of every combination of outcomes of ``cases``, the
    lengths a plan is checked at before it stands for the code's decisions of them."""
    picked: dict[tuple, list[int]] = {}
    for L in range(1, 3 * chunk + per_case + 1):
        key = tuple(CASES[name](L, chunk) for name in sorted(cases))
        if len(picked.setdefault(key, [])) < per_case:
            picked[key].append(L)
    return sorted(L for lengths in picked.values() for L in lengths)


__all__ = ["CASES", "chunking_case", "case_lengths"]
