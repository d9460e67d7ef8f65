"""What a converted layer was converted for: the inputs of its example call, checked on every call.

A converted layer runs graphs traced on its example call: one input per leaf of that call's
arguments, every tensor of the example's rank, every size that is neither the batch nor the
sequence fixed, every other value (``h``, ``w``, a flag) baked in. A call that differs — an
optional mask passed or left out, a tensor of another rank or width, another ``h`` — would fail
deep inside a graph with a raw exception, or silently use the baked-in value. ``CallSignature``
answers it first, with an ``UnsupportedShapeError`` naming the input and saying what to pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..errors import UnsupportedShapeError
from ..validation import input_name

#: how many inputs a message lists before it stops
_SHOWN = 8


@dataclass(frozen=True)
class Leaf:
    """One input of the example call: a tensor's rank and fixed sizes, or a baked-in value."""

    name: str                           # "#0" (positional) or "'store_mask'" (keyword)
    rank: int | None = None             # None: not a tensor
    shape: tuple = ()                   # the example's sizes
    value: object = None                # a non-tensor input's value

    def describe(self, batch_axis: int | None, token_axis: int | None) -> str:
        if self.rank is None:
            return f"{self.name} = {self.value!r}"
        dims = ["B" if a == batch_axis else "L" if a == token_axis else str(n)
                for a, n in enumerate(self.shape)]
        return f"{self.name}: a tensor [{', '.join(dims)}]"


def _same_value(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:               # a value whose == is not a bool
        return False


@dataclass(frozen=True)
class CallSignature:
    """The leaves of the example call, in the order the converted layer's graphs take them."""

    leaves: tuple[Leaf, ...]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "CallSignature":
        leaves = []
        for path, x in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
            if isinstance(x, torch.Tensor):
                leaves.append(Leaf(input_name(path, "input"), x.dim(), tuple(x.shape)))
            else:
                leaves.append(Leaf(input_name(path, "input"), value=x))
        return cls(tuple(leaves))

    def describe(self, batch_axis: dict, token_axis: dict) -> str:
        shown = [leaf.describe(batch_axis.get(i), token_axis.get(i))
                 for i, leaf in enumerate(self.leaves[:_SHOWN])]
        more = len(self.leaves) - _SHOWN
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")

    def check(self, flat: list, batch_axis: dict, token_axis: dict, ref: int,
              path: str) -> None:
        """Raise ``UnsupportedShapeError`` when ``flat`` (a call's inputs, flattened) is not a
        call the converted layer's graphs can run."""
        what = f"the converted {path or 'layer'}"
        expected = self.describe(batch_axis, token_axis)
        tail = (f"It was converted for calls with {expected}; call it that way, or convert it "
                "again with example inputs like this call's.")
        if len(flat) != len(self.leaves):
            raise UnsupportedShapeError(
                f"{what} was called with {len(flat)} input(s) (arguments and keyword arguments, "
                f"None included), but it was converted for {len(self.leaves)}. {tail}")
        B = L = None
        x = flat[ref]
        if isinstance(x, torch.Tensor) and x.dim() == self.leaves[ref].rank:
            B = x.shape[batch_axis[ref]]
            L = x.shape[token_axis[ref]] if ref in token_axis else None
        for i, (leaf, x) in enumerate(zip(self.leaves, flat)):
            problem = self._problem(leaf, x, batch_axis.get(i), token_axis.get(i), B, L)
            if problem:
                raise UnsupportedShapeError(f"{what} was called with {leaf.name} {problem}. "
                                            f"{tail}")

    @staticmethod
    def _problem(leaf: Leaf, x, b_axis, t_axis, B, L) -> str:
        """What is wrong with input ``x`` where ``leaf`` was given ('' when nothing is)."""
        if leaf.rank is None:
            if isinstance(x, torch.Tensor) or not _same_value(x, leaf.value):
                shown = "a tensor" if isinstance(x, torch.Tensor) else repr(x)
                return (f"= {shown}, but the value {leaf.value!r} it was converted with is "
                        "built into the converted graphs")
            return ""
        if not isinstance(x, torch.Tensor):
            return f"= {type(x).__name__ if x is not None else 'None'}, not a tensor"
        if x.dim() != leaf.rank:
            return f"of shape {tuple(x.shape)}: {x.dim()} axes, not {leaf.rank}"
        for a, (n, n0) in enumerate(zip(x.shape, leaf.shape)):
            if a == b_axis:
                if B is not None and n != B:
                    return f"of shape {tuple(x.shape)}: batch {n}, but the call's batch is {B}"
            elif a == t_axis:
                if L is not None and n != L:
                    return f"of shape {tuple(x.shape)}: {n} tokens, but the call has {L}"
            elif n != n0:
                return f"of shape {tuple(x.shape)}: axis {a} has size {n}, not {n0}"
        return ""


__all__ = ["CallSignature", "Leaf"]
