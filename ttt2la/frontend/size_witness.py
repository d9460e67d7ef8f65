"""Sizes read at a second length, which tell a size of the length from a coincidence.

The run of ``size_uses`` takes a size for a value of the length or the batch size where it is a
multiple of the run's length ``L*`` or batch size ``B*``: a causal convolution's ``L* + 3``
outputs, a multiple of ``B* = 5`` at ``L* = 112``, were taken for ``23·B``, and a branch on them
(``if y.shape[-1] > 200``) judged a decision of the batch size, so the plan ran at every length;
``L + 4`` after four memory tokens, ``L − 1`` after a shift, a multiple of neither, were plain
numbers, and a cut of them (``h[:, :128]``) no decision at all. The code runs at two lengths
(``length_vouching``); here each run keys every size it reads outside the loop by the user's line
and the read's order there (``Witness``), and each size read at both is checked against the
other run: a guess that does not give the other run's size is replaced by the line through the
two where it grows by whole tokens (a size of the length's, ``L + 3``), and a size that differs
between the runs but was no multiple is given that line too (``L + 4``, ``L − 1``). A count of
pieces (``L // C``, which the traces fit) and a size that bends between the two lengths
(``max(L, 96)``) lie on no such line: there the run's own reading stands, unless it took the
size for the batch's, which the two runs show it is not (``ceil((L + 4) / 2)``): that size is
known at the two lengths only, so every decision made with it is one of the length. A run's
decisions read their sizes through its table, so the first run's are corrected once the second
has run.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable


class Witness:
    """The sizes one run read, by key ``(file, line, read, item)``, and the function of the call's
    sizes each stands for (``table``), checked against ``other``: the run at another length."""

    def __init__(self, L: int, B: int, other: "Witness | None" = None):
        self.L, self.B, self.other = L, B, other
        self.seen: dict[tuple, int] = {}
        self.table: dict[tuple, Callable] = {}
        self.reads: dict[tuple[str, int], int] = {}

    def read(self, file: str, line: int) -> int:
        """The order of this read of sizes among those at ``file:line``."""
        n = self.reads.get((file, line), 0)
        self.reads[(file, line)] = n + 1
        return n

    def size(self, key: tuple, n: int, guess: Callable | None) -> Callable | None:
        """The function size ``n`` read at ``key`` stands for: ``guess`` (a multiple of the run's
        length or batch, or ``None``), unless the other run read another size there; a function
        that looks its value up in this run's table, so ``settle`` can still correct it."""
        self.seen[key] = n
        other = self.other
        at = guess if other is None or key not in other.seen else \
            _through(guess, (self.L, n), (other.L, other.seen[key]), self.B)
        if at is None:
            return None
        self.table[key] = at
        return lambda L, B: self.table[key](L, B)

    def settle(self, other: "Witness") -> None:
        """Check this run's guesses against ``other``'s sizes, read after this run ended."""
        for key, at in self.table.items():
            if key in other.seen:
                self.table[key] = _through(at, (self.L, self.seen[key]),
                                           (other.L, other.seen[key]), self.B)


def _through(guess: Callable | None, first: tuple[int, int], second: tuple[int, int],
             B: int) -> Callable | None:
    """``guess`` where it gives both runs' sizes (``(length, size)`` each, at batch size
    ``B``); else the line through the two, a function of the length, where it grows by whole
    tokens; else ``guess`` still (``None`` for a size no run took for one of the call's)."""
    (L1, n1), (L2, n2) = first, second
    try:
        if guess is not None and guess(L1, B) == n1 and guess(L2, B) == n2:
            return guess
    except Exception:
        pass
    if L1 == L2 or n1 == n2 and guess is None:
        return guess
    slope = Fraction(n2 - n1, L2 - L1)
    if slope.denominator == 1:
        return lambda L, B: int(n1 + slope * (L - L1))
    if guess is not None and _same(guess, L1, L2, B):
        # taken for the batch's, yet it moves with the length (``ceil((L + 4) / 2)``): a size
        # of the length no line gives, known at the two runs' lengths only
        return lambda L, B: n1 if L == L1 else n2 if L == L2 else _unreadable()
    # a count of pieces (``L // C``) the traces fit, or a size of the length that bends
    # between the two (``max(L, 96)``), which no line gives: the run's own reading stands
    return guess


def _same(guess: Callable, L1: int, L2: int, B: int) -> bool:
    """Does ``guess`` take one value at both lengths (a size of the batch, or a constant)?"""
    try:
        return guess(L1, B) == guess(L2, B)
    except Exception:
        return False


def _unreadable():
    raise ValueError("a size of the length that no line through the two runs gives")
