"""Caches a layer's forward fills on itself, traced as its constructor left them.

A rotary embedding that keeps its cos/sin table on itself, and builds it again when asked for a
longer length (``if seqlen > self._seq_len_cached: self._cos_cached = ...``), computes the same
function whether the table is filled or not. A trace does not: it reads a table filled for
longer lengths as a constant and builds one where the table is too short, so traces at lengths
on either side of the table's length hold different ops, and the length comparison decides a
branch the converted layer cannot vouch for. ``settle_start`` decides, once per layer, where its
traces start (``as_found.traced_as_found``): where ``__init__`` sets an attribute to a constant
(``self._cos_cached = None``) that the forward, run from it, assigns, and the layer computes
the same at its example's length and at twice it from that constant as from the value it holds,
the traces start from the constant — the converted graphs build the table as the
layer's first call does, at any length. A forward that writes at every call (a step counter, the
last fast weights) is refused, as is one that fills an attribute at its first call and computes
another function after (a scale fixed by the first call's length).
"""
from __future__ import annotations

import ast
import functools

import torch
import torch.utils._pytree as pytree

from .as_found import buffers_kept, found_attributes, set_plain, start_traces_from
from .attribute_guard import plain_attributes
from .original_class import original_class
from .side_effects import run_written, self_assignments
from .testing import same_value

#: a layer's call: ``(args, kwargs)``
Call = tuple[tuple, dict]


def settle_start(module: torch.nn.Module, call: Call, longer: Call | None
                 ) -> tuple[list[str], bool, tuple[str, ...]]:
    """Decide where the traces of ``module`` start, from its example ``call`` and the same at
    another length (``longer``; ``None`` where none is known). Returns ``(refused, once,
    caches)``: what its forward writes that is no cache (``once``: filled at the first call
    only; nothing: none), and the caches it fills (``"rotary._cos_cached"``), whose values do
    not change what it computes."""
    found = found_attributes(module)
    start = _constructed_start(module, found, [c for c in (call, longer) if c is not None])
    for m, attributes in start:
        start_traces_from(m, attributes)
    first = _run(module, start, call)
    if first is None or not first[1]:
        return [], False, ()
    second = _run(module, first[2], call)
    if second is None:
        return [], False, ()
    if second[1]:
        return second[1], False, ()         # written at every call
    if longer is not None:
        fresh, filled = _run(module, start, longer), _run(module, first[2], longer)
        if fresh is not None and filled is not None and not _agree(fresh[0], filled[0]):
            return first[1], True, ()
    return [], False, tuple(first[1])


def _constructed_start(module: torch.nn.Module, found: list, calls: list[Call]) -> list:
    """``found`` with the caches the forward fills set as constructed — those the constructor
    sets to a constant that the forward, run from it, assigns again — where the layer computes
    the same from them on every call of ``calls`` as from ``found``; else ``found``."""
    paths = {id(m): path for path, m in module.named_modules(remove_duplicate=False)}
    cooled = [constructed_values(m, held) for m, held in found]
    if not any(cooled):
        return found
    first = _run(module, _with(found, cooled), calls[0])
    if first is None:
        return found
    cooled = [{name: value for name, value in values.items()
               if (f"{paths[id(m)]}.{name}" if paths.get(id(m)) else name) in first[1]}
              for (m, _), values in zip(found, cooled)]
    if not any(cooled):
        return found
    constructed = _with(found, cooled)
    for call in calls:
        held, built = _run(module, found, call), _run(module, constructed, call)
        if held is None or built is None or not _agree(held[0], built[0]):
            return found
    return constructed


def _with(found: list, values: list[dict]) -> list:
    """Each module of ``found`` with its attributes, ``values`` set over them."""
    return [(m, {**held, **v}) for (m, held), v in zip(found, values)]


def constructed_values(module: torch.nn.Module, held: dict | None = None) -> dict:
    """The constants ``module``'s constructor gives the plain attributes its other methods
    assign, for those it holds (``held``: its plain attributes) with another value."""
    held = plain_attributes(module) if held is None else held
    return {name: value for name, value in _constructed(original_class(type(module))).items()
            if name in held and not _same(held[name], value)}


@functools.lru_cache(maxsize=256)
def _constructed(cls: type) -> dict:
    """``{attribute: constant}`` over ``cls`` and its user-written bases: what ``__init__``
    sets to a constant and another method assigns (the subclass's statements first)."""
    found = [a for klass in cls.__mro__
             if klass is not object and not klass.__module__.startswith("torch.")
             for a in self_assignments(klass)]
    later = {name for method, name, _, _ in found if method != "__init__"}
    out: dict = {}
    for method, name, node, _ in found:
        if method == "__init__" and name in later and name not in out:
            value = _constant_given(node, name)
            if value is not _NONE:
                out[name] = value
    return out


_NONE = object()


def _constant_given(node: ast.AST, name: str):
    """The constant the assignment ``node`` gives the attribute ``name`` (``self.name = 0``,
    ``self.a, self.name = 1, None``); ``_NONE`` where it gives another value."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return _NONE
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        pairs = zip(target.elts, node.value.elts) \
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
            and len(target.elts) == len(node.value.elts) else [(target, node.value)]
        for t, v in pairs:
            if isinstance(t, ast.Attribute) and t.attr == name and isinstance(v, ast.Constant):
                return v.value
    return _NONE


def _run(module: torch.nn.Module, state: list, call: Call):
    """``module``'s forward on ``call`` from the plain attributes ``state`` (``[(module,
    attributes)]``): ``(output, attributes written, state after)``, everything put back after;
    ``None`` where the call fails."""
    with buffers_kept(module):
        for m, attributes in state:
            set_plain(m, attributes)
        try:
            out, written = run_written(module, *call)
        except Exception:
            return None
        return out, written, [(m, plain_attributes(m)) for m, _ in state]


def _agree(a, b) -> bool:
    """Two outputs of the layer agree, value by value (``testing.same_value``)."""
    xs, x_spec = pytree.tree_flatten(a)
    ys, y_spec = pytree.tree_flatten(b)
    return x_spec == y_spec and all(map(same_value, xs, ys))


def _same(a, b) -> bool:
    return a is b or type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b


__all__ = ["settle_start", "constructed_values"]
