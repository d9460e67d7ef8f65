"""Values a converted layer's code reads by name from outside the layer, guarded at every call.

``attribute_guard`` watches what a layer holds in its own ``__dict__``. A constant the code
reads off its class (``self.GAIN`` where ``GAIN`` is a class attribute) or a module-level
global (``CONFIG["scale"]``) is baked into the traces the same way, and changing it after
conversion changed the original's output but not the converted one's (0.67 relative RMS off,
reported exact). ``GlobalGuard`` records, at conversion, the plain values (numbers, strings,
containers of them, as ``attribute_guard.plain_value`` says) that the layer's classes hold and
that the functions of its code — its classes' methods and the functions they call by name or
hold (a helper the layer was given, ``loaded_values``), three calls deep — read as globals or
from their closures (a class defined in a factory function, a helper made by one), and tells at
each call whether one changed: one tuple comparison. Code is watched by identity as
well: a method of the layer's classes that its code calls by name (``self.close``) or
``forward``, and a function of the user's it calls as a global, rebound since conversion
(``Layer.close = other``), ran the old code in the traces (0.33 relative RMS off before).
Classes and modules are left out (rebinding one is not watched).
"""
from __future__ import annotations

import dis
import functools
import linecache
import os
import sys
import types
from dataclasses import dataclass

import torch

from .attribute_guard import Change, comparable, plain_value
from .frontend.user_code import is_users
from .loaded_values import Attributes, LoadedValues, codes, load_kind
from .original_class import ORIGINAL

_MISSING = object()

#: how many calls deep the functions a layer's methods call by name are read
_DEPTH = 3


def _library(cls: type) -> bool:
    """A class the user's code does not define (``user_code.is_users`` of its module's file; a
    module without one, as a notebook's, is the user's, but for the builtins)."""
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return cls.__module__ == "builtins" if file is None else not is_users(file)


def _library_code(fn: types.FunctionType) -> bool:
    """A function whose code is not the user's (a wrapper such as ``torch.compile``'s takes its
    wrapped function's ``__module__``, not its file)."""
    return not is_users(fn.__code__.co_filename)


def _made_by_library(fn: types.FunctionType) -> bool:
    """A function a library made from text (``dataclasses``' ``__init__``, whose code is
    ``<string>``'s) for a module of its own."""
    if not fn.__code__.co_filename.startswith("<"):
        return False
    file = getattr(sys.modules.get(fn.__module__), "__file__", None)
    return isinstance(file, str) and not is_users(file)


def _watchable(value) -> bool:
    return not callable(value) and not isinstance(value, (type, types.ModuleType)) \
        and plain_value(value)


def _code(value) -> bool:
    """A function a class holds, as the class holds it (a method, static or class method)."""
    return isinstance(value, (types.FunctionType, staticmethod, classmethod))


def _user_classes(layer: torch.nn.Module):
    """``(cls, most, m)``: each of the user's classes of ``layer``'s modules once, with the most
    derived user class of a module ``m`` it is found in (where a class attribute is looked up,
    so one set on a subclass since is seen)."""
    seen = set()
    for m in layer.modules():
        mro = [c for c in type(m).__mro__
               if c is not object and ORIGINAL not in c.__dict__ and not _library(c)]
        for cls in mro:
            if cls not in seen:
                seen.add(cls)
                yield cls, mro[0], m


def _functions(cls: type):
    for v in vars(cls).values():
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        elif isinstance(v, property):
            v = v.fget
        if isinstance(v, types.FunctionType):
            yield v


def _reads(fn: types.FunctionType, depth: int, seen: set, out: dict,
           layer_code: "LayerCode") -> None:
    """The globals ``fn`` (and the user functions it names or holds, ``depth`` more calls deep)
    reads; ``layer_code``: the layer's, where an attribute may hold such a function."""
    if fn in seen:
        return
    seen.add(fn)
    codes, g = [fn.__code__], fn.__globals__
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        for name in global_names(code):
            if name not in g:
                continue
            value = g[name]
            user_function = isinstance(value, types.FunctionType) and not _library_code(value)
            if user_function and depth > 0:
                _reads(value, depth - 1, seen, out, layer_code)
            if user_function or _watchable(value):
                where = os.path.basename(g.get("__file__") or "") or g.get("__name__", "?")
                kind = "a function" if user_function else "a global"
                out.setdefault((id(g), name), (lambda g=g, n=name: g.get(n, _MISSING),
                                               f"{name} ({kind} of {where})"))
    cells = () if _made_by_library(fn) else fn.__closure__ or ()
    for name, cell in zip(fn.__code__.co_freevars, cells):
        value = _contents(cell)
        if isinstance(value, types.FunctionType) and not _library_code(value) or \
                _watchable(value):
            kind = "a function" if isinstance(value, types.FunctionType) else "a variable"
            out.setdefault((id(cell), name), (lambda c=cell: _contents(c),
                                              f"{name} ({kind} of {fn.__qualname__}'s closure)"))
    for held in (_held_functions(fn, layer_code) if depth > 0 else ()):
        _reads(held, depth - 1, seen, out, layer_code)


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` loads as globals (``co_names`` holds its attribute names too: a
    global named like an attribute the code reads, ``shape`` beside ``x.shape``, is none)."""
    return frozenset(ins.argval for ins in dis.get_instructions(code)
                     if ins.opname in _GLOBAL_LOADS)


def _contents(cell: types.CellType):
    """What a closure's cell holds now (``_MISSING`` while it is empty)."""
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


class LayerCode:
    """The functions of a layer's code (``functions``: its user classes' methods and the user
    functions they call by name, ``_DEPTH`` calls deep, and those they reach otherwise,
    ``_held_functions``) and what their names load (``loaded``), read once for every guard
    ``install`` builds (five readings before, about 0.1 s of a small layer's conversion)."""

    def __init__(self, layer: torch.nn.Module):
        self.attributes = Attributes(list(layer.modules()))
        self._loaded: dict[types.FunctionType, LoadedValues] = {}
        found: dict = {}

        def visit(fn: types.FunctionType, depth: int) -> None:
            if fn in found:
                return
            found[fn] = None
            codes, g = [fn.__code__], fn.__globals__
            while codes and depth > 0:
                code = codes.pop()
                codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
                for name in code.co_names:
                    value = g.get(name)
                    if isinstance(value, types.FunctionType) and not _library_code(value):
                        visit(value, depth - 1)
            for held in (_held_functions(fn, self) if depth > 0 else ()):
                visit(held, depth - 1)

        for klass, _, _ in _user_classes(layer):
            for fn in _functions(klass):
                visit(fn, _DEPTH)
        self.functions: list[types.FunctionType] = list(found)

    def loaded(self, fn: types.FunctionType) -> LoadedValues:
        """What the names ``fn``'s code loads hold now (read once)."""
        if fn not in self._loaded:
            self._loaded[fn] = LoadedValues(fn, self.attributes)
        return self._loaded[fn]

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """Every name the code holds as an attribute or global name (``co_names``), and
        ``forward``, which torch calls: what it may look up on its modules (read once, for the
        attribute guard and ``GlobalGuard`` alike)."""
        names = {"forward"}
        for fn in self.functions:
            for code, _ in codes(fn):
                names.update(code.co_names)
        return frozenset(names)


def read_off_classes(layer: torch.nn.Module, read: frozenset[str]) -> dict[type, frozenset[str]]:
    """Per class of ``layer``'s modules, the names in ``read`` that one of the user's classes in
    its MRO holds and an attribute set on a module would shadow (not a data descriptor, as a
    property is): where the code reads ``self.close`` or torch calls ``forward``."""
    out: dict[type, frozenset[str]] = {}
    for m in layer.modules():
        kind = type(m)
        if kind in out:
            continue
        found = set()
        for c in kind.__mro__:
            if c is not object and ORIGINAL not in c.__dict__ and not _library(c):
                found |= {n for n, v in vars(c).items() if n in read and not _data(v)}
        out[kind] = frozenset(found)
    return out


def _data(value) -> bool:
    """A data descriptor (a property, a slot): an instance's ``__dict__`` does not shadow it."""
    return hasattr(type(value), "__set__") or hasattr(type(value), "__delete__")


def _held_functions(fn: types.FunctionType, layer_code: "LayerCode"):
    """The user functions ``fn``'s code reaches other than by a global's name: held by its
    closure, a parameter's default, an attribute of the layer (``self.finish = finish``) or of
    an object a global holds (``helpers.finish``, a static method)."""
    values = layer_code.loaded(fn)
    for code, top in codes(fn):
        for kind, name in values.names(code, top):
            for value in (values.of(kind, name) if kind != "global" else ()):
                if isinstance(value, types.FunctionType) and not _library_code(value):
                    yield value


def names_read(layer: torch.nn.Module, wanted, objects=None,
               layer_code: LayerCode | None = None) -> dict[str, str]:
    """``{name: "file:line (`code`)"}``: which of the names ``wanted`` (functions and
    attributes, as ``code.co_names`` holds them) ``layer``'s code (``LayerCode``, read now
    unless ``layer_code`` holds it) reads, each at the first line found; and which keys of
    ``objects`` (``{key: object}``) it loads under whatever name (``LoadedValues``: an alias, a
    global, a reader the layer holds)."""
    by_id = {id(o): (o, key) for key, o in (objects or {}).items()}
    read = LayerCode(layer) if layer_code is None else layer_code
    out: dict[str, str] = {}
    for fn in read.functions:
        values = read.loaded(fn)
        for code, top in codes(fn):
            held = {}                   # (kind, name) -> the keys of the objects it loads
            for kind, name in (values.names(code, top) if by_id else ()):
                keys = [by_id[id(v)][1] for v in values.of(kind, name)
                        if id(v) in by_id and by_id[id(v)][0] is v]
                if keys:
                    held[kind, name] = keys
            hits = wanted.intersection(code.co_names)
            if not hits and not held:
                continue
            for ins in dis.get_instructions(code):
                # a name, or two where one instruction loads two locals (LOAD_FAST_LOAD_FAST)
                names = [n for n in (ins.argval if isinstance(ins.argval, tuple)
                                     else (ins.argval,)) if isinstance(n, str)]
                keys = [n for n in names if n in hits]
                keys += [k for n in names for k in held.get((load_kind(ins.opname), n), [])]
                for key in keys:
                    if key not in out:
                        out[key] = _line(code.co_filename, _line_of(code, ins.offset))
    return out


def _line_of(code: types.CodeType, offset: int) -> int:
    starts = sorted((o, n) for o, n in dis.findlinestarts(code) if n is not None)
    return ([n for o, n in starts if o <= offset] or [code.co_firstlineno])[-1]


def _line(file: str, line: int) -> str:
    code = linecache.getline(file, line).strip()
    return f"{file}:{line}" + (f" (`{code}`)" if code else "")


@dataclass(frozen=True)
class GlobalGuard:
    """The class attributes and globals a converted layer's code reads, at conversion."""

    entries: tuple[tuple, ...]      # (a reader of the value now, what to call it)
    values: tuple

    @classmethod
    def of(cls, layer: torch.nn.Module, layer_code: LayerCode | None = None
           ) -> "GlobalGuard | None":
        """Record them now (``None``: the code reads none); ``layer_code``: the layer's, where
        the caller has read it already."""
        found: dict = {}
        seen: set = set()
        layer_code = LayerCode(layer) if layer_code is None else layer_code
        read = layer_code.names
        for klass, most, m in _user_classes(layer):
            own = vars(m)
            for name, value in vars(klass).items():
                if name in own:
                    continue
                if not name.startswith("__") and _watchable(value) or name in read and _code(value):
                    kind = "a class attribute" if _watchable(value) else "a method"
                    found.setdefault((id(most), name), (
                        lambda k=most, n=name: getattr(k, n, _MISSING),
                        f"{most.__name__}.{name} ({kind})"))
            for fn in _functions(klass):
                _reads(fn, _DEPTH, seen, found, layer_code)
        if not found:
            return None
        entries = tuple(found.values())
        return cls(entries, tuple(comparable(get()) for get, _ in entries))

    def changed(self) -> Change | None:
        """The first value that differs from conversion (``None`` when none does)."""
        now = tuple(get() for get, _ in self.entries)
        if now == self.values:
            return None
        for (_, what), then, value in zip(self.entries, self.values, now):
            if not (value is then or _equal(value, then)):
                return Change(what, then, value)
        return None


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


__all__ = ["GlobalGuard", "LayerCode", "names_read", "read_off_classes"]
