"""A partial last chunk padded with zeros, checked once against the code as written.

The plan pads a partial last chunk with zero tokens where its probe of the body finds them inert
(``lowering.executors.padding_problem``). That probe differentiates the body, so it cannot see a
constant each padded token adds whatever its value — ``Σ_t (v_t + 1)``, a count of the chunk's
tokens by ``ones_like(...).sum()`` — and a body made for whole chunks cannot be run on fewer
tokens to compare. The layer itself can: at conversion, the exact converted layer (its loop run
as traced, padded) and the layer as written (its last chunk short) are compared at a length
that leaves the last chunk partial. Where they differ, the padding is not inert and calls with
a partial chunk run as written (exact conversions) or are refused (lossy ones).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .errors import ConversionError
from .frontend.recognize import _inputs_at
from .frontend.single_step import FixedLengthLayout
from .lowering.check import needs_float64_reference
from .testing import rel_rms_error, tolerance


def _outputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Every floating-point tensor ``module`` returns, flattened (states returned included)."""
    with torch.no_grad():
        out = module(*args, **kwargs)
    return [t.detach().flatten() for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def partial_length(length: int, chunk: int) -> int:
    """A length near ``length`` that leaves its last chunk of ``chunk`` tokens partial, with at
    least one whole chunk before it and half a chunk in it."""
    return max(length // chunk, 1) * chunk + max(chunk // 2, 1)


def padding_changes(original: torch.nn.Module, converted: torch.nn.Module, state, args: tuple,
                    kwargs: dict, as_traced) -> str:
    """What zero padding of a partial last chunk changes (``"the layer's outputs by …"``), or
    ``""`` where it changes nothing.

    ``converted`` is ``original`` converted exactly with ``state``; ``as_traced(state, args,
    kwargs)`` is the context in which it runs its loop as traced (the recurrent executor, the
    user's ops in the user's order), so the comparison separates the padding from the plan.
    Skipped (``""``) where nothing is padded, where the layer as written does not take the
    length, and for Newton–Schulz below float64, where rounding alone separates two correct
    evaluations.
    """
    program, layout = state.program, state.layout
    chunk = program.chunk_size
    if chunk <= 1 or program.partial_chunk or isinstance(layout, FixedLengthLayout):
        return ""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    B, L = layout.sizes(flat)
    length = partial_length(L, chunk)
    new_args, new_kwargs = pytree.tree_unflatten(_inputs_at(flat, layout, B, length), spec)
    try:
        expected = _outputs(original, new_args, new_kwargs)
    except Exception:           # the layer as written takes no such length: nothing to compare
        return ""
    if not expected or needs_float64_reference(program, expected[0].dtype):
        return ""
    try:
        with as_traced(state, new_args, new_kwargs):
            got = _outputs(converted, new_args, new_kwargs)
    except ConversionError:     # the converted layer refuses the length (its probe saw why)
        return ""
    if len(got) != len(expected) or any(a.shape != b.shape for a, b in zip(got, expected)):
        return ""
    err = max(rel_rms_error(a, b) for a, b in zip(got, expected))
    if err <= tolerance(expected[0].dtype):
        return ""
    return (f"the layer's outputs by a relative RMS error of {err:.1e} at L = {length} "
            f"(chunks of {chunk}): the loop adds something per token that a zero token does "
            "not cancel (a count of the chunk's tokens, a constant added to each)")


__all__ = ["padding_changes", "partial_length"]
