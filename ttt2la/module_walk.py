"""One walk of a converted layer's modules per call: its guards and its weights together.

A converted layer's call checks that no hook would run on a submodule (``submodule_hooks``) and
that no plain attribute it was traced with changed (``attribute_guard``), and, where a plan
runs, reads its parameters and buffers (``ir.params_and_buffers``): three walks of the same
modules, each a few microseconds of Python, and more when run cold after the user's forward.
``ModuleWalk`` records the layer's module tree at conversion — each module's parent, name,
class, number of children and watched attributes, in ``named_modules`` order with empty child
slots — and checks all of it in one pass: a module at each recorded place, of the recorded
class, with as many children (so no module was added that the pass would not visit), the
attributes unchanged, and no hook on any submodule. A call that passes runs its plan with the
weights gathered from the modules the pass found; any other call asks the guards themselves,
which say what changed (``quiet``: ``None``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.modules import module as _nn

from .attribute_guard import AttributeGuard
from .ir import _walks_plainly


@dataclass(frozen=True)
class _Step:
    """One place in the layer's module tree: the module found there at conversion."""

    parent: int                 # index of its parent's step (-1 for the layer itself)
    name: str                   # its name in the parent's ``_modules``
    kind: type                  # its class (``NoneType`` for an empty slot)
    children: int               # entries of its ``_modules``, empty slots included
    get: Callable[[dict], tuple]    # its watched attributes, from its ``__dict__``
    values: tuple               # their values at conversion (``attribute_guard.comparable``)
    prefix: str                 # its weights' name prefix ("o_proj." ; "" for the layer)


@dataclass(frozen=True)
class ModuleWalk:
    """A converted layer's module tree at conversion, checked in one pass per call."""

    steps: tuple[_Step, ...]
    plain: bool                 # every class walks its members as ``nn.Module`` does

    @classmethod
    def of(cls, layer: torch.nn.Module, attributes: AttributeGuard) -> "ModuleWalk":
        """Record ``layer``'s tree now, with the attributes ``attributes`` watches."""
        watched = {w.path: w for w in attributes.modules}
        steps: list[_Step] = []

        def visit(m, parent: int, name: str, path: tuple) -> None:
            if m is None:
                steps.append(_Step(parent, name, type(None), 0, _nothing, (), ""))
                return
            w = watched[path]
            at = len(steps)
            steps.append(_Step(parent, name, type(m), len(m._modules), w.get, w.values,
                               ".".join(path) + "." if path else ""))
            for child_name, child in m._modules.items():
                visit(child, at, child_name, (*path, child_name))

        visit(layer, -1, "", ())
        plain = all(_walks_plainly(s.kind) for s in steps if s.kind is not type(None))
        return cls(tuple(steps), plain)

    def quiet(self, layer: torch.nn.Module) -> list | None:
        """The modules at each step (``None`` at an empty slot) where the layer's tree is as
        recorded, its attributes unchanged and no hook would run on a submodule; ``None``
        where any of that may not hold (the guards then say what)."""
        if _nn._global_forward_pre_hooks or _nn._global_forward_hooks \
                or _nn._global_backward_pre_hooks or _nn._global_backward_hooks \
                or torch.compiler.is_compiling():
            return None
        found: list = []
        try:
            for s in self.steps:
                m = found[s.parent]._modules[s.name] if s.parent >= 0 else layer
                found.append(m)
                if type(m) is not s.kind:
                    return None
                if m is None:
                    continue
                d = m.__dict__
                if len(d["_modules"]) != s.children or not s.get(d) == s.values:
                    return None
                if s.parent >= 0 and (d["_forward_pre_hooks"] or d["_forward_hooks"]
                                      or d["_backward_pre_hooks"] or d["_backward_hooks"]):
                    return None
        except Exception:           # a submodule gone, an attribute deleted, a tensor replaced
            return None
        return found

    def weights(self, found: list) -> dict[str, torch.Tensor] | None:
        """The layer's parameters, then its buffers, by name, read off the modules ``quiet``
        found, as ``params_and_buffers`` names them (a module or tensor met again skipped);
        ``None`` where a class walks its members its own way."""
        if not self.plain:
            return None
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        modules: set = set()
        seen_params: set = set()
        seen_buffers: set = set()
        for s, m in zip(self.steps, found):
            if m is None or id(m) in modules:
                continue
            modules.add(id(m))
            prefix = s.prefix
            for name, t in m._parameters.items():
                if t is not None and id(t) not in seen_params:
                    seen_params.add(id(t))
                    params[prefix + name] = t
            for name, t in m._buffers.items():
                if t is not None and id(t) not in seen_buffers:
                    seen_buffers.add(id(t))
                    buffers[prefix + name] = t
        params.update(buffers)
        return params


def _nothing(d: dict) -> tuple:
    return ()


__all__ = ["ModuleWalk"]
