"""Why a layer's code as written computes another function from one call to the next.

A conversion traces the layer once and checks the converted layer against the code as written on
the example call. Two causes in the user's code make that check fail although every pass is
exact: random numbers drawn in the forward (noise on the keys, a random mask), which no two runs
share, and a branch on ``torch.is_grad_enabled()``, whose trace (gradients on) holds the other
branch than the check's run (gradients off). ``call_variation`` runs the code as written twice on
the example, then once with gradients on, recording every torch call with its user line; the
first call whose result differs names the line to change. A forward that changes its input in
place (``x.mul_(2)``, ``x /= n``) makes the second run see other inputs, which would read as
random numbers drawn at whatever op first computes with them: the first run watches the inputs'
version counters, and the op that changed one is named instead.
"""
from __future__ import annotations

import sys

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .as_found import buffers_kept
from .frontend.user_code import is_users


def call_variation(module: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """``""`` when ``module`` computes the same on its example call each time and in either
    grad mode, else what differs, where, and what to do. The module's buffers and the random
    generators are left as they were."""
    with buffers_kept(module), torch.random.fork_rng(devices=[]):
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        changed: list = []
        first = _recorded(module, args, kwargs, grad=False, inputs=inputs, changed=changed)
        if changed:
            return _changes_its_input(changed[0])
        again = _recorded(module, args, kwargs, grad=False)
        found = _first_difference(first, again)
        if found is not None:
            return _random(found)
        with_grad = _recorded(module, args, kwargs, grad=True)
    found = _first_difference(first, with_grad)
    return "" if found is None else _grad_mode(found)


def _random(found: tuple) -> str:
    (name, where), _ = found
    return (f"its output differs between two runs on the same inputs: the torch call `{name}` "
            f"at {where} returns other values each time (random numbers), so no conversion can "
            "be checked against the code as written, nor reproduce its draws. Draw the noise "
            "only in training mode (`if self.training:` — a conversion traces and checks "
            "evaluation mode, and runs the layer as written in training mode), pass it in as an "
            "input, or remove it before converting")


def _changes_its_input(found: tuple) -> str:
    name, where = found
    return (f"its forward changes its input in place: the torch call `{name}` at {where} "
            "writes into a tensor the call passed, so each run on the same inputs sees other "
            "values, and no conversion can be checked against the code as written. Compute on "
            "a new tensor instead (`x = x * 2` rather than `x.mul_(2)` or `x *= 2`)")


def _grad_mode(found: tuple) -> str:
    off, on = found
    at = on if on is not None else off
    other = f"; without them, `{off[0]}` at {off[1]}" if on is not None and off is not None \
        and off[1] != on[1] else ""
    return (f"it computes another function when gradients are enabled (a branch on "
            f"torch.is_grad_enabled(), say): with gradients on it runs `{at[0]}` at {at[1]} "
            f"where it differs{other}. A conversion traces the layer with gradients on and "
            "checks it without (torch.no_grad()), so no one converted graph computes both. Make "
            "the branch depend on something the call states (self.training, an argument) "
            "rather than the grad mode, or take it out before converting")


def _first_difference(a: list, b: list) -> tuple | None:
    """``((name, where) of a, (name, where) of b)`` at the first call whose name or result
    differs (either side ``None`` past its end), or ``None``."""
    for x, y in zip(a, b):
        if x[0] != y[0] or not _same(x[2], y[2]):
            return (x[0], x[1]), (y[0], y[1])
    if len(a) != len(b):
        x = a[len(b)] if len(a) > len(b) else None
        y = b[len(a)] if len(b) > len(a) else None
        return (x and (x[0], x[1])), (y and (y[0], y[1]))
    return None


def _same(x: list, y: list) -> bool:
    if len(x) != len(y):
        return False
    for u, v in zip(x, y):
        if isinstance(u, torch.Tensor) != isinstance(v, torch.Tensor):
            return False
        if isinstance(u, torch.Tensor):
            if u.shape != v.shape or u.dtype != v.dtype or not torch.equal(u, v):
                return False
        elif u != v:
            return False
    return True


def _recorded(module, args, kwargs, *, grad: bool, inputs: list = (),
              changed: list | None = None) -> list:
    """Every torch call of one run of ``module``, gradients on or off: ``(name,
    file:line (`code`), results)``, the results detached copies; ``changed`` gains ``(name,
    file:line)`` of the first call that wrote into one of the tensors ``inputs``."""
    calls: list = []
    try:
        with torch.set_grad_enabled(grad), _Recorder(calls, inputs, changed):
            module(*args, **kwargs)
    except Exception:           # a run that fails records what it ran up to the failure
        pass
    return calls


class _Recorder(TorchFunctionMode):
    def __init__(self, calls: list, inputs=(), changed: list | None = None):
        super().__init__()
        self.calls, self.changed = calls, changed
        self.versions = [(t, t._version) for t in inputs]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        if self.versions and not self.changed and \
                any(t._version != v for t, v in self.versions):
            self.changed.append((name, _user_line()))
        if name not in ("__get__", "size", "dim"):
            leaves = [x.detach().clone() if isinstance(x, torch.Tensor) else x
                      for x in pytree.tree_leaves(out)]
            self.calls.append((name, _user_line(), leaves))
        return out


def _user_line() -> str:
    """``file:line (`code`)`` of the innermost frame of the user's code."""
    import linecache

    f = sys._getframe(2)
    while f is not None:
        file = f.f_code.co_filename
        if is_users(file):
            code = linecache.getline(file, f.f_lineno).strip()
            return f"{file}:{f.f_lineno}" + (f" (`{code}`)" if code else "")
        f = f.f_back
    return "an unknown line"
