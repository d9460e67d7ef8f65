"""Where a scan over the chunks beats a Python loop over them, for states the checker proves
scannable: one switch that forces either path, and the cost rule of scalar-affine states.

A scan gets every chunk's state at once, but it materialises all of them (``n`` states, several
times over in its terms and compositions) where the loop carries one. On a CUDA device or under
a compiler there is no Python loop to save, so the scan always runs; on a CPU it pays only where
the loop's dispatch per chunk outweighs that traffic: small states over many chunks.
(``lift_delta.scan_pays`` is the rule of matrix-affine states, whose scan also composes maps;
``decayed_op_pays`` that of decayed states lifted onto the block op.)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

#: The CPU cost model of a scalar-affine state ``S' = a ⊙ S + f``, fitted to a 10-shape grid of
#: gated memories (2 cores, fp32; docs/benchmarks.md, "CPU: gated memories"; it picks the faster
#: path at every point; ``benchmarks/gated_memories.py --fit-rule`` refits it): one chunk step of
#: the loop costs this much in dispatch (s) ...
AFFINE_LOOP_STEP_SECONDS = 20e-6
#: ... and the scan this much per element of every chunk's state it materialises (s): the update
#: at zero and its derivative batched over chunks, the scan itself and the states before each
#: chunk, each a pass over ``n`` states. (The fitted fixed cost came out below zero: none.)
AFFINE_SCAN_ELEMENT_SECONDS = 12e-9

_forced: bool | None = None


@contextmanager
def scanning(always: bool | None):
    """Within the block, scan every scannable group (``True``), loop over the chunks (``False``)
    or let the cost rules decide (``None``): for tests of either path and for benchmarks that
    time both."""
    global _forced
    before, _forced = _forced, always
    try:
        yield
    finally:
        _forced = before


def forced() -> bool | None:
    """What ``scanning`` forces now (``None``: the cost rules decide)."""
    return _forced


def affine_scan_pays(state: torch.Tensor) -> bool:
    """Is the scan faster than the loop over the chunks for this scalar-affine state (its
    initial value, batch included)? Both sides cost per chunk, so the number of chunks does not
    decide. Always on CUDA and under a compiler; on a CPU for states of
    fewer than about 1,700 elements (a ``[4, 4, 8, 8]`` memory scanned 1.2–2.9× faster than
    looped, a ``[4, 4, 64, 64]`` one 5× slower)."""
    decided = _always(state)
    if decided is not None:
        return decided
    return state.numel() * AFFINE_SCAN_ELEMENT_SECONDS < AFFINE_LOOP_STEP_SECONDS


def _always(state: torch.Tensor) -> bool | None:
    """What holds whatever the state's size: the forced path, or the chunk-parallel form on
    CUDA and under a compiler (no Python loop to save there); None on a CPU."""
    if _forced is not None:
        return _forced
    if state.device.type == "cuda" or torch.compiler.is_compiling():
        return True
    return None


#: The same trade for a decayed state lifted onto ``block_linear_attention``, whose
#: chunk-parallel form reads each chunk's state once (or, in groups of chunks, one state per
#: group): it pays below this many state elements on a CPU (batch included), read off the
#: op-forced and loop-forced columns of ``benchmarks/gated_memories.py`` (``docs/benchmarks.md``:
#: the op 1.4-4.9x the source up to 4,096 elements, behind the loop from 16,384 on).
DECAYED_OP_MAX_ELEMENTS = 8192


def decayed_op_pays(state: torch.Tensor) -> bool:
    """Does the runtime op beat a loop over the chunks for this decayed state (``W' = γW + Δ``,
    its initial value, batch included)? Always on CUDA and under a compiler; on a CPU below
    ``DECAYED_OP_MAX_ELEMENTS``."""
    decided = _always(state)
    return decided if decided is not None else state.numel() < DECAYED_OP_MAX_ELEMENTS


__all__ = ["AFFINE_LOOP_STEP_SECONDS", "AFFINE_SCAN_ELEMENT_SECONDS", "affine_scan_pays",
           "DECAYED_OP_MAX_ELEMENTS", "decayed_op_pays", "forced", "scanning"]
