"""Shape-only tensor values evaluated for real while a layer is traced with fake tensors.

Index and mask code often builds a small tensor from Python numbers and reads it back:
``torch.arange(0, L, window).tolist()``, ``torch.arange(n).tolist()``, ``.item()`` on a size.
Under ``make_fx`` with fake tensors such a read fails (a fake tensor has no data), although the
value depends on no input. ``shape_only_values()`` keeps, beside every tensor computed only from
Python values (and from other such tensors), its real value — computed on the side with every
tracing mode switched off — and answers ``.tolist()``, ``.item()``, ``int()``, ``float()``,
``bool()`` and iteration on it from that value. Tensors derived from a layer input, a parameter
or a random draw have no real value and fail as before (the tracer reports the line).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

#: Reads of a tensor's data, answered from its real value.
_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__iter__}

#: Functions whose results are not determined by their arguments.
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like,
           torch.randn_like, torch.randint_like, torch.bernoulli, torch.multinomial,
           torch.normal, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_,
           torch.Tensor.bernoulli_, torch.Tensor.exponential_}

#: Reading metadata never needs a real value and must not be evaluated on the side.
_SKIP_NAMES = {"__get__", "__set__", "size", "dim", "numel", "stride", "is_contiguous",
               "data_ptr", "requires_grad_", "register_hook", "backward"}


class _ShapeValues(TorchFunctionMode):
    """Tracks the real values of tensors computed from Python values only."""

    def __init__(self):
        super().__init__()
        self._real: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def real(self, x) -> torch.Tensor | None:
        """The real value of the traced tensor ``x``, if it has one."""
        entry = self._real.get(id(x))
        return entry[1] if entry is not None and entry[0]() is x else None

    def _remember(self, x: torch.Tensor, real: torch.Tensor) -> None:
        key = id(x)
        self._real[key] = (weakref.ref(x, lambda _: self._real.pop(key, None)), real)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        real = self.real(args[0]) if func in _READS and args else None
        if real is not None:
            if func is torch.Tensor.__iter__:       # traced elements, each with its real value
                elements = list(func(*args, **kwargs))
                for element, value in zip(elements, real.unbind(0)):
                    self._remember(element, value)
                return iter(elements)
            return func(real, *args[1:], **kwargs)
        out = func(*args, **kwargs)
        if func in _RANDOM or getattr(func, "__name__", "") in _SKIP_NAMES:
            return out
        leaves = pytree.tree_leaves((args, kwargs))
        if all(not isinstance(x, torch.Tensor) or self.real(x) is not None for x in leaves) and \
                any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(out)):
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        """Evaluate ``func`` on the real values of its arguments; remember each result's."""
        swap = lambda x: self.real(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        try:
            with _disable_current_modes(), torch._C._DisableFuncTorch(), \
                    torch._C._ExcludeDispatchKeyGuard(
                        torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
                real = func(*pytree.tree_map(swap, args), **pytree.tree_map(swap, kwargs))
        except Exception:                 # noqa: BLE001 — no real value: reads fail as before
            return
        outs, reals = pytree.tree_leaves(out), pytree.tree_leaves(real)
        if len(outs) != len(reals):
            return
        for o, r in zip(outs, reals):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) \
                    and not isinstance(r, torch._subclasses.FakeTensor):
                self._remember(o, r)


@contextlib.contextmanager
def shape_only_values():
    """Within this context, data reads of shape-only tensors return their real values."""
    with _ShapeValues():
        yield


__all__ = ["shape_only_values"]
