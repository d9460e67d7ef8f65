"""Whether a converted layer's inputs record gradients, guarded at every call where its code
reads it.

A branch on an input's ``requires_grad``, ``is_leaf`` or ``grad_fn`` is decided when the layer
is traced, and the trace sees its inputs detached: none requires grad, each a leaf without a
``grad_fn``. The converted graphs hold the branch taken then, so a call on an input that
records gradients (a leaf after ``requires_grad_()``, an earlier layer's output in training)
silently took the traced branch (0.6–1.0 relative RMS off on a two-branch layer); the
conversion's gradient check, which differentiates through leaf inputs, saw such a branch only
where it changed a gradient. Where the layer's code reads one of these names
(``global_guard.names_read``), ``AutogradGuard`` makes a call with an input that requires grad,
or with a parameter whose ``requires_grad`` changed since conversion (the trace read the
parameters' own), run the code as written (exact levels) or refuse naming the line (lossy
ones), through ``changed_call``. A layer that reads none keeps no guard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attribute_guard import Change, Shown
from .global_guard import LayerCode, names_read

#: the tensor attributes that tell whether a tensor records gradients, and how it was made
_READS = frozenset({"requires_grad", "is_leaf", "grad_fn"})
#: the attributes' descriptors, found under whatever name the code holds them
_DESCRIPTORS = {name: getattr(torch.Tensor, name) for name in _READS}


def _recording(flat: list) -> str:
    """What records gradients among the inputs (``""`` when none does)."""
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            how = "a leaf" if t.is_leaf else f"made by `{type(t.grad_fn).__name__}`"
            return f"input {i} requiring gradients ({how})"
    return ""


@dataclass(frozen=True)
class AutogradGuard:
    """For a layer whose code reads whether tensors record gradients: ``changed`` is ``None``
    while no input requires grad and every parameter requires it as at conversion."""

    where: str                          # the read, as the messages name it
    parameters: tuple[bool, ...]        # each parameter's ``requires_grad`` at conversion

    @classmethod
    def of(cls, layer: torch.nn.Module, layer_code: LayerCode | None = None
           ) -> "AutogradGuard | None":
        """``None`` where ``layer``'s code reads none of ``requires_grad``, ``is_leaf`` and
        ``grad_fn`` (``layer_code``: the layer's, where the caller has read it already)."""
        found = names_read(layer, _READS, _DESCRIPTORS, layer_code)
        if not found:
            return None
        name, line = next(iter(found.items()))
        return cls(f"whether the inputs record gradients (`.{name}` read at {line})",
                   tuple(p.requires_grad for p in layer.parameters()))

    def changed(self, layer: torch.nn.Module, flat: list) -> Change | None:
        """What records gradients otherwise than the trace saw (``None`` when nothing does)."""
        recording = _recording(flat)
        if recording:
            return Change(self.where, Shown("no input requiring gradients"), Shown(recording))
        now = tuple(p.requires_grad for p in layer.parameters())
        if now == self.parameters:
            return None
        names = [n for (n, p), then in zip(layer.named_parameters(), self.parameters)
                 if p.requires_grad != then]
        return Change(self.where, Shown("the parameters' requires_grad as at conversion"),
                      Shown(f"requires_grad changed on {', '.join(names) or 'the parameters'}"))


__all__ = ["AutogradGuard"]
