"""The memory layout of a converted layer's inputs, guarded at every call where its code reads it.

A branch on ``x.is_contiguous()``, on ``x.stride()`` or on ``x.storage_offset()`` is decided when
the layer is traced, on the example's layout, and the converted graphs hold the branch taken
then: a transposed or sliced input later took the other branch in the original and silently
the traced one in the converted layer (0.98 relative RMS off on a two-branch layer). Where the
layer's code reads one of these (``global_guard.names_read``: by its name, or by the method a
name holds, as ``contiguous = torch.Tensor.is_contiguous``), ``LayoutGuard`` keeps the
example's layout — for each input tensor, contiguous or its strides, and its storage offset
where the code reads that — and a call whose inputs are laid out otherwise runs the code as
written (exact levels) or refuses naming the line (lossy ones), through ``changed_call``. A
contiguous input's strides follow from its shape, which the conversion's other guards cover.
A layer that reads none of them keeps no guard; one that does pays about 0.3 µs a call for one
input (``is_contiguous`` and a comparison). The names are found by reading the code, so a
layer reading some other ``stride`` (an attribute of its own) keeps the guard as well: its only
cost is that call's, and running as written the calls with another layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .attribute_guard import Change, Shown
from .global_guard import LayerCode, names_read

#: the tensor methods that read a layout, and whether each reads the storage offset
_READS = {"is_contiguous": False, "stride": False, "is_non_overlapping_and_dense": False,
          "storage_offset": True}
#: the tensor methods themselves, found under whatever name the code holds them
#: (``contig = torch.Tensor.is_contiguous``)
_METHODS = {name: getattr(torch.Tensor, name) for name in _READS if hasattr(torch.Tensor, name)}


def _layouts(flat: list) -> list:
    """Each input tensor's layout: ``True`` when contiguous, else its strides."""
    if len(flat) == 1:                  # the common call, without a comprehension's frame
        t = flat[0]
        return [t.is_contiguous() or t.stride()] if isinstance(t, torch.Tensor) else []
    return [t.is_contiguous() or t.stride() for t in flat if isinstance(t, torch.Tensor)]


def _placed(flat: list) -> list:
    """Each input tensor's layout and storage offset."""
    return [(t.is_contiguous() or t.stride(), t.storage_offset())
            for t in flat if isinstance(t, torch.Tensor)]


def _described(key: tuple, offset: bool) -> str:
    parts = []
    for k in key:
        layout, at = k if offset else (k, None)
        text = "contiguous" if layout is True else f"strides {tuple(layout)}"
        parts.append(text if at is None else f"{text}, storage offset {at}")
    return "; ".join(parts) or "no tensors"


@dataclass(frozen=True)
class LayoutGuard:
    """The example inputs' layout, for a layer whose code reads layouts: ``key(flat) ==
    example`` while a call's inputs are laid out as the example's were."""

    where: str                  # the read, as the messages name it
    key: Callable[[list], list]     # ``_layouts``, or ``_placed`` where the code reads offsets
    example: list | None        # ``key`` of the example inputs (``None``: not recorded)

    @classmethod
    def of(cls, layer: torch.nn.Module, flat: list | None,
           layer_code: LayerCode | None = None) -> "LayoutGuard | None":
        """``None`` where ``layer``'s code reads no layout; ``flat``: the example inputs
        flattened as a call's are (``None``: unknown, taken as contiguous at offset 0);
        ``layer_code``: the layer's, where the caller has read it already."""
        found = names_read(layer, frozenset(_READS), _METHODS, layer_code)
        if not found:
            return None
        name, line = next(iter(found.items()))
        key = _placed if any(_READS[n] for n in found) else _layouts
        return cls(f"the memory layout of the inputs (`.{name}()` read at {line})", key,
                   None if flat is None else key(flat))

    def changed(self, flat: list) -> Change | None:
        """The call's layout where it differs from the example's (``None`` when it does not)."""
        now = self.key(flat)
        then = self.example
        if then is None:        # no example recorded: contiguous at offset 0
            then = [(True, 0) if self.key is _placed else True for _ in now]
        if now == then:
            return None
        offset = self.key is _placed
        return Change(self.where, Shown(_described(then, offset)),
                      Shown(_described(now, offset)))


__all__ = ["LayoutGuard"]
