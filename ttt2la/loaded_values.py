"""What the names a converted layer's code loads hold at conversion, however they are spelled.

The guards find what the code reads by the names it spells (``global_guard.names_read``):
``torch.get_default_dtype()`` names its reader, but ``from torch import get_default_dtype as
gdd``, a global ``READ = torch.get_default_dtype``, ``import torch.backends.mkldnn as mk`` or a
reader the layer holds (``self.reader``) spell none of it, and a setting changed since
conversion went unseen (0.97 relative RMS off). ``LoadedValues`` resolves the names a
function's code loads to the values they hold at conversion — a global or builtin, a closure's
cell, a parameter's default, an attribute of the layer's modules, of an object they hold
(``self.cfg.read``) or of an object the code's globals hold, and the items of a tuple, list or
dict among them — so that the guards find their readers by the object as well, and the
functions of a layer's code take in a user function held so (``self.finish = finish``,
``helpers.finish``).
"""
from __future__ import annotations

import builtins
import types

import torch

_MISSING = object()


def _unwrapped(value):
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _held(value) -> list:
    """``value`` as code calling or reading it meets it: a static or class method's function,
    a bound method and its function, a tuple's, list's or dict's items besides (one level)."""
    value = _unwrapped(value)
    out = [value]
    if isinstance(value, types.MethodType):
        out.append(value.__func__)
    elif isinstance(value, (tuple, list)):
        out += [_unwrapped(v) for v in value]
    elif isinstance(value, dict):
        out += [_unwrapped(v) for v in value.values()]
    return out


def load_kind(opname: str) -> str | None:
    """Where an instruction loads its name from: ``global``, ``cell``, ``local``, ``attribute``
    (``None``: it loads no name's value)."""
    if "LOAD_FAST" in opname:           # STORE_FAST_LOAD_FAST too (Python 3.13)
        return "local"
    if not opname.startswith("LOAD_") or opname == "LOAD_CLOSURE":
        return None
    if "GLOBAL" in opname or opname == "LOAD_NAME":
        return "global"
    if "DEREF" in opname:
        return "cell"
    if "ATTR" in opname or opname == "LOAD_METHOD":
        return "attribute"
    return None


class Attributes:
    """The attributes objects hold as stored — their own ``__dict__`` and their class's (a
    class's own and its bases') — read without running a property, a descriptor or
    ``__getattr__``; ``modules``: the layer's, whose attributes, and those of the objects with
    attributes they hold (``self.cfg``), every function's attribute loads may read."""

    def __init__(self, modules: list):
        self._dicts: dict[int, tuple] = {}
        self._merged: dict[int, tuple] = {}
        held = [v for m in modules for v in vars(m).values()
                if not isinstance(v, (torch.nn.Module, torch.Tensor)) and self._own(v) is not None]
        self._layer = list({id(b): b for b in modules + held}.values())
        self._found: dict[str, list] = {}

    @staticmethod
    def _own(base):
        """``base``'s own ``__dict__`` (a class's too), ``None`` where it has none; not read by
        ``getattr``, so that a class's ``__getattr__`` is not run."""
        try:
            own = object.__getattribute__(base, "__dict__")
        except Exception:               # an object of slots, a number: no attributes held
            return None
        return own if isinstance(own, dict) or isinstance(base, type) else None

    def _of(self, base) -> tuple[dict, ...]:
        """Where a name is looked up on ``base``: its own ``__dict__``, then its class's (or, for
        a class, its own) MRO merged into one dict, a derived class's entry winning."""
        if id(base) not in self._dicts:
            if isinstance(base, type):
                dicts = (self._classes(base),)
            else:
                own = self._own(base)
                dicts = (() if own is None else (own,)) + (self._classes(type(base)),)
            self._dicts[id(base)] = (base, dicts)     # the base is kept, so its id stays its
        return self._dicts[id(base)][1]

    def _classes(self, cls: type) -> dict:
        """The dicts of ``cls``'s MRO (``object``'s left out) as one, as lookup finds names."""
        if id(cls) not in self._merged:            # by id: a metaclass may define ``==``
            merged: dict = {}
            for c in reversed(cls.__mro__):
                if c is not object:
                    merged.update(vars(c))
            self._merged[id(cls)] = (cls, merged)
        return self._merged[id(cls)][1]

    def _lookup(self, bases: list, name: str) -> list:
        out = []
        for base in bases:
            for d in self._of(base):
                value = d.get(name, _MISSING)
                if value is not _MISSING:
                    out.append(value)
                    break
        return out

    def get(self, bases: list, name: str) -> list:
        """``name`` as the layer's modules, the objects they hold and ``bases`` hold it (the
        first dict holding it, as Python's lookup finds it), those holding none left out."""
        if name not in self._found:
            self._found[name] = self._lookup(self._layer, name)
        return self._found[name] + self._lookup(bases, name)


class LoadedValues:
    """What the names one function's code loads hold at conversion."""

    def __init__(self, fn: types.FunctionType, attributes: Attributes):
        code, g = fn.__code__, fn.__globals__
        b = g.get("__builtins__", builtins)
        self._globals, self._builtins = g, (b if isinstance(b, dict) else vars(b))
        self._cells: dict = {}
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                self._cells[name] = cell.cell_contents
            except ValueError:          # a cell not filled yet
                pass
        positional = code.co_varnames[:code.co_argcount]
        self._defaults = dict(zip(positional[len(positional) - len(fn.__defaults__ or ()):],
                                  fn.__defaults__ or ()))
        self._defaults.update(fn.__kwdefaults__ or {})
        self._fn, self._attributes = fn, attributes
        self._bases: list | None = None
        self._found: dict = {}

    def _global(self, name: str):
        value = self._globals.get(name, _MISSING)
        return self._builtins.get(name, _MISSING) if value is _MISSING else value

    def _attribute_bases(self) -> list:
        """The objects the code's globals hold (modules, classes, namespaces): where, besides
        the layer, an attribute it loads may be read from."""
        if self._bases is None:
            names = sorted({n for code, _ in codes(self._fn) for n in code.co_names})
            values = [self._global(n) for n in names]
            self._bases = [v for v in values if v is not _MISSING
                           and not isinstance(v, torch.Tensor) and Attributes._own(v) is not None]
        return self._bases

    def names(self, code: types.CodeType, top: bool):
        """``(kind, name)``: each name ``code`` may load (``top``: ``fn``'s own code, not one
        nested in it), as ``load_kind`` says where from."""
        for name in code.co_names:
            yield "global", name
            yield "attribute", name
        for name in code.co_freevars + code.co_cellvars:
            yield "cell", name
        if top:
            for name in code.co_varnames:
                yield "local", name

    def of(self, kind: str, name: str) -> list:
        """The values a load of ``name`` from ``kind`` can give at conversion."""
        if (kind, name) not in self._found:
            if kind == "global":
                found = [self._global(name)]
            elif kind == "attribute":
                found = self._attributes.get(self._attribute_bases(), name)
            else:
                found = [self._cells.get(name, _MISSING), self._defaults.get(name, _MISSING)]
            self._found[kind, name] = [h for v in found if v is not _MISSING for h in _held(v)]
        return self._found[kind, name]


def codes(fn: types.FunctionType) -> list[tuple[types.CodeType, bool]]:
    """``(code, top)``: ``fn``'s code and the code nested in it (``top``: ``fn``'s own)."""
    out, todo = [], [(fn.__code__, True)]
    while todo:
        code, top = todo.pop()
        out.append((code, top))
        todo += [(c, False) for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


__all__ = ["Attributes", "LoadedValues", "codes", "load_kind"]
