"""The dtypes and devices of the inputs a layer was traced with: a call with others is not one
its graphs hold.

Tracing records a cast that does nothing on the example as nothing — ``x.float()`` of a float32
input, ``x.to(self.weight.dtype)`` — so graphs traced with float32 inputs hold no cast. Called
with float64 or bfloat16 inputs they would compute in the call's dtype where the code as written
casts, or fail in a product of two dtypes: eagerly the code as written then decides, but inside a
compiled graph the failure escapes as torch's own error. Such a call is decided before the plan
runs, from the inputs' dtypes and devices (which ``torch.compile`` guards on): an exact conversion
runs the code as written, a lossy one refuses. A layer whose weights were cast since conversion
expects its inputs cast as they were (``recast.weights_cast``), as the layer converted again for
them was traced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .recast import Signature, weights_cast


@dataclass(frozen=True)
class InputTypes:
    """The example call's ``(dtype, device)`` per flattened input (``None`` for a value), and
    the inputs' names as messages give them."""

    types: tuple
    names: tuple

    @classmethod
    def of(cls, flat: list, names: list[str] | None = None) -> "InputTypes":
        types = tuple((t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in flat)
        if names is None or len(names) != len(flat):
            names = [f"input {i}" for i in range(len(flat))]
        return cls(types, tuple(names))

    def cast(self, was: Signature, now: Signature) -> "InputTypes":
        """The types the layer expects once its weights were cast from ``was`` to ``now``."""
        dtypes, device = weights_cast(was, now)
        return InputTypes(tuple(None if t is None else
                                (dtypes.get(t[0], t[0]), t[1] if device is None else device)
                                for t in self.types), self.names)

    def differs(self, flat: list) -> str:
        """The first input of the call ``flat`` in another dtype or on another device than the
        example's, described (``""`` where none is)."""
        for name, want, t in zip(self.names, self.types, flat):
            if want is None or not isinstance(t, torch.Tensor):
                continue
            if t.dtype != want[0] or t.device != want[1]:
                return (f"{name} in {_shown(t.dtype, t.device)}, where the layer was traced with "
                        f"{_shown(*want)}")
        return ""


def _shown(dtype: torch.dtype, device: torch.device) -> str:
    return f"{dtype} on {device}"


__all__ = ["InputTypes"]
