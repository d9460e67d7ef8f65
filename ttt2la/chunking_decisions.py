"""Decisions on the length that a chunked plan makes itself, which then need no vouching.

TTT-Linear's scan in mini-batches decides ``if n > 0:`` (run the scan over the whole mini-batches)
and ``if rest > 0:`` (run the remaining tokens as one more call), with ``n, rest = divmod(L, K)``.
``size_uses`` records both, and a layer whose code decides on the length holds only the lengths
it was traced at (``LengthVouching``). Yet the plan, which reads the two calls as one loop with a
partial last chunk, runs no whole chunk where ``n == 0`` and pads no partial one where
``rest == 0``: it makes both decisions itself.

A decision needs no vouching when both hold:

1. its outcome at every length is one of the plan's own cases (``frontend.chunking_cases``: a
   whole chunk, a partial last chunk), so lengths it tells apart, the plan tells apart as well;
2. the layer's exact plan — built from the same probe traces as the converted one, which all
   lie in one combination of the cases — computes the code as written at two lengths of every
   combination of outcomes of those decisions: the plan's cases are the code's branches, not
   just the same partition of the lengths.

The converted layer then holds at every length (its lossy passes change the loop's body, not
its chunking or the code around the loop), and the decisions are dropped from its vouching. A
decision that is no case of the plan (``o * 2 if T % 8 else o + 2`` with chunks of 4), or one
around code the plan does not reproduce (the same with chunks of 8: the exact plan differs from
the code at a length of whole chunks), keeps it.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .as_found import buffers_kept
from .frontend.chunking_cases import case_lengths
from .frontend.length_values import describe
from .length_vouching import LengthVouching, _same


def vouched_cases(held: LengthVouching | None, rl, twin, original: torch.nn.Module) -> list:
    """The decisions of ``held`` that are the plan's own cases and that the exact plan
    (``twin``: its state and the module it is installed on) was checked to reproduce against
    ``original``, the layer as written (point 2 above); ``[]`` where it differs, fails, or
    there are none."""
    from .frontend.recognize import _inputs_at as inputs_at     # recognize imports this

    cases = [v for v in (held.found if held is not None else ()) if v.chunking]
    if not cases or twin is None or (rl.program.chunk_size or 1) < 2:
        return []
    lengths = case_lengths({v.chunking for v in cases}, rl.program.chunk_size)
    state, converted = twin
    flat, _ = pytree.tree_flatten((tuple(rl.candidate.args), dict(rl.candidate.kwargs)))
    B = flat[rl.layout.ref].shape[rl.layout.batch_axis[rl.layout.ref]]
    kept, runs, fallbacks = state.length_vouching, dict(state.runs), dict(state.fallbacks)
    state.length_vouching = None                # the plan itself, at every length
    try:
        with torch.no_grad(), buffers_kept(converted, original):
            for L in lengths:
                args, kwargs = pytree.tree_unflatten(inputs_at(flat, rl.layout, B, L),
                                                     rl.in_spec)
                try:
                    agree = _same(converted(*args, **kwargs), original(*args, **kwargs))
                except Exception:
                    agree = False
                if not agree:
                    return []
    finally:
        state.length_vouching = kept
        for record, before in ((state.runs, runs), (state.fallbacks, fallbacks)):
            record.clear()
            record.update(before)           # the checks are no calls of the layer
    return cases


def without(held: LengthVouching, values: list) -> LengthVouching | None:
    """``held`` without the uses ``values`` (``None`` where no use is left): the shapes it
    holds keyed again by the sizes the uses left read."""
    gone = {(v.file, v.line, v.of) for v in values}
    found = tuple(v for v in held.found if (v.file, v.line, v.of) not in gone)
    if not found:
        return None
    by = tuple(of for of in held.by if any(v.of == of for v in found))
    out = LengthVouching(describe(list(found)), by=by, found=found)
    for key, ok in held.lengths.items():
        B, L = key if isinstance(key, tuple) else (key, key)
        new = out.key(B, L)
        out.lengths[new] = out.lengths.get(new, True) and ok
    return out


def cases_note(values: list) -> str:
    """The report's note on the decisions ``vouched_cases`` found."""
    return (f"its code decides on the length ({describe(values)}) as its plan does by itself "
            f"({', '.join(sorted({v.chunking for v in values}))} or not), and the exact plan "
            "computes the code as written in every combination of them: those decisions hold "
            "at every length")


def drop_cases(state, lines: tuple) -> None:
    """Drop from ``state``'s vouching the decisions of the plan's cases at ``lines``
    (``(file, line)``, as a conversion found them with ``vouched_cases``): a converted layer
    built again from its record (unpickled) holds where the conversion found it does."""
    held = state.length_vouching
    if held is None or not lines:
        return
    values = [v for v in held.found if v.chunking and (v.file, v.line) in set(lines)]
    if values:
        state.length_vouching = without(held, values)


__all__ = ["vouched_cases", "without", "cases_note", "drop_cases"]
