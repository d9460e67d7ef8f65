"""The containers a layer returns, kept through its trace: a ``torch.Size`` stays a ``torch.Size``.

``make_fx`` writes a traced function's output into the graph's output node, where fx makes every
tuple of values a plain ``tuple``, and takes the output's structure from that node: a layer that
returns ``y, y.shape`` was converted into one returning ``y, (2, 24, 8)`` — equal to the
``torch.Size``, but of another type (``isinstance(s, torch.Size)`` and ``s.numel()`` fail).
``recording`` keeps the structure the function itself returned while it is traced, and
``with_output_types`` makes it the graph's output structure where the two differ only in tuple
types (a ``torch.return_types`` result comes back as itself then). ``pytree`` still unflattens a
``torch.Size`` as a plain tuple (torch's tracing registers it so, for symbolic sizes), so
``typed_output`` gives the converted layer the function that makes those tuples ``torch.Size``
again at each call — ``None``, costing nothing, for a layer that returns none. A dataclass the
layer returns (``Output(y, state)``) is a leaf to ``pytree`` until registered, on which the trace
failed ("the loop did not run"); ``dataclass_nodes`` registers it as ``torch.export`` asks users to.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from .dataclass_nodes import carry_dataclasses


def recording(fn: Callable, specs: list) -> Callable:
    """``fn``, appending the structure of what it returns to ``specs`` at each call."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        carry_dataclasses(out)
        specs.append(pytree.tree_structure(out))
        return out
    return run


def _as_tuples(spec: pytree.TreeSpec):
    """``spec`` with every tuple type a plain tuple, as fx's output node has it."""
    if spec.is_leaf():
        return None
    kind = tuple if issubclass(spec.type, tuple) else spec.type
    context = None if kind is tuple else spec.context
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return kind, context, [_as_tuples(c) for c in children]


def with_output_types(gm: torch.fx.GraphModule, specs: list) -> torch.fx.GraphModule:
    """``gm`` returning its output in the structure ``specs`` last recorded, where that differs
    from the graph's own only in its tuple types (a graph without a pytree output, or with
    another structure, is left as it is)."""
    codegen = gm.graph._codegen
    if not specs or not isinstance(codegen, _PyTreeCodeGen):
        return gm
    info, spec = codegen.pytree_info, specs[-1]
    if info.out_spec is None or info.out_spec == spec or \
            _as_tuples(info.out_spec) != _as_tuples(spec):
        return gm
    codegen.pytree_info = _PyTreeInfo(info.orig_args, info.in_spec, spec)
    gm.recompile()
    return gm


def _children(spec: pytree.TreeSpec) -> list:
    return list(spec.children() if hasattr(spec, "children") else spec.children_specs)


def _holds_size(spec: pytree.TreeSpec) -> bool:
    return not spec.is_leaf() and (spec.type is torch.Size or
                                   any(_holds_size(c) for c in _children(spec)))


def typed_output(spec: pytree.TreeSpec | None) -> Callable | None:
    """The function that gives an output of structure ``spec`` its ``torch.Size`` values back
    (``None`` where ``spec`` holds none)."""
    if spec is None or not _holds_size(spec):
        return None
    return functools.partial(_typed, spec=spec)


def _typed(x, spec: pytree.TreeSpec):
    if not _holds_size(spec):
        return x
    if spec.type is torch.Size:
        return torch.Size(x)
    kids = _children(spec)
    if isinstance(x, dict):
        return type(x)((k, _typed(x[k], c)) for k, c in zip(spec.context, kids))
    if isinstance(x, (list, tuple)):
        items = [_typed(v, c) for v, c in zip(x, kids)]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def output_spec(gm) -> pytree.TreeSpec | None:
    """The output structure of ``gm``'s code (``None``: it returns its output node as it is)."""
    codegen = getattr(getattr(gm, "graph", None), "_codegen", None)
    return codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) else None


__all__ = ["recording", "with_output_types", "typed_output", "output_spec"]
