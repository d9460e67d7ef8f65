"""State-free values that a loop over the chunks computes per chunk, not batched beforehand.

A state's update chunk after chunk reads values that do not depend on the state, and the plan
computes those once, batched over every chunk, before the loop. For a value larger than what it
is computed from, that batch is the wrong trade: an outer product ``lr · kᵀv`` the size of the
state, batched over 128 chunks of a ``[4, 4, 64, 64]`` memory, is 32 MiB written once and read
once — on a CPU each such block is faulted in page by page — where the user's own loop computes
each chunk's product in cache and folds it into the state at once. Such *expansions* are
computed inside the loop's graph from their smaller inputs, as the user's loop does; the values
and their gradients are the same, only where they are computed moves.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.fx


def _numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _chain(value: torch.fx.Node, movable: set[torch.fx.Node]) -> tuple[set, list]:
    """The nodes computing ``value`` at its size or larger (it among them), and what they read."""
    size = _numel(value)
    chain, reads, stack = set(), [], [value]
    while stack:
        n = stack.pop()
        if n in chain:
            continue
        chain.add(n)
        for a in n.all_input_nodes:
            if a in movable and _numel(a) >= size:
                stack.append(a)
            elif a not in reads:
                reads.append(a)
    return chain, [a for a in reads if a not in chain]


def expansions(frontier: Iterable[torch.fx.Node], movable: set[torch.fx.Node]
               ) -> set[torch.fx.Node]:
    """The nodes a loop over the chunks should compute itself: for each value of its
    ``frontier`` in ``movable`` (state-free, reading the chunk's streams), the chain computing
    it at its size, when that chain reads fewer elements than the value holds."""
    moved: set[torch.fx.Node] = set()
    for value in frontier:
        if value not in movable:
            continue
        chain, reads = _chain(value, movable)
        if sum(_numel(a) for a in reads) < _numel(value):
            moved |= chain
    return moved


#: Below this many elements (batch included), an expansion stays batched before the loop: each
#: op moved into the loop costs a few µs of dispatch per chunk, which writing and reading back a
#: small value does not. Measured on gated memories (``benchmarks/gated_memories.py
#: --expansions``, 2 cores, fp32, both allocator settings): increments of 4,096 elements looped
#: 0.84-0.90x as fast moved as batched, of 16,384 0.97-1.10x, of 65,536 1.16-2.46x.
EXPANSION_MIN_ELEMENTS = 16384


def expansions_pay(moved: set[torch.fx.Node], state: torch.Tensor, traced_state: int) -> bool:
    """Compute the ``moved`` nodes in the loop on a call whose state is ``state``? When the
    largest of them, scaled from the trace's sizes by the state's (``traced_state`` elements
    there), holds at least ``EXPANSION_MIN_ELEMENTS``, and always on CUDA and under a compiler."""
    if state.device.type == "cuda" or torch.compiler.is_compiling():
        return True
    largest = max(_numel(n) for n in moved)
    return largest * state.numel() >= EXPANSION_MIN_ELEMENTS * traced_state


__all__ = ["EXPANSION_MIN_ELEMENTS", "expansions", "expansions_pay"]
