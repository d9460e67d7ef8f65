"""Plain Python attributes a converted layer's code was traced with, guarded at every call.

A trace bakes the values of a layer's plain attributes — a chunk size, a step size, a switch, a
function held as an attribute, a tensor that is no parameter or buffer — into its graphs, as
``torch.compile`` does. Unlike ``torch.compile``, nothing would look at them again, so setting
``layer.eta`` after conversion went unseen. ``AttributeGuard`` records them when a layer is
converted (its own and its submodules', with each submodule's class; torch's and ttt2la's own
bookkeeping left out) and tells at each call, cheaply, whether one changed since: one tuple
comparison per module. The converted layer then runs its code as written (an exact
conversion) or refuses (a lossy one), naming the attribute (``converted.ConvertedState``).
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import operator
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.nn.utils import parametrize

from .object_fields import Fields, plain_object

#: What torch keeps in every module's ``__dict__``: hook tables, the parameter, buffer and
#: submodule dicts, the ``training`` flag (whose own check is ``training_mode``), the compiled
#: call ``Module.compile`` sets.
BOOKKEEPING = frozenset(vars(torch.nn.Module())) | {"_compiled_call_impl"}
#: What ttt2la itself sets on a converted layer or model.
OWN_PREFIXES = ("_ttt2la", "ttt2la_")

#: Values that cannot change in place: compared as they are.
_IMMUTABLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
              torch.layout, torch.memory_format, enum.Enum, type, range, slice,
              types.FunctionType, types.BuiltinFunctionType, types.MethodType)

_MISSING = object()


def watched(name: str) -> bool:
    """Whether an attribute of that name is the user's: not torch's or ttt2la's bookkeeping."""
    return name not in BOOKKEEPING and not name.startswith(OWN_PREFIXES)


def plain_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """The user's attributes held in ``module``'s own ``__dict__`` (not its parameters, buffers
    or submodules, which torch keeps in tables of their own)."""
    return {k: v for k, v in vars(module).items() if watched(k)}


def plain_value(value, depth: int = 0) -> bool:
    """Whether ``value`` is made of immutable values only, through containers, dataclasses and
    objects of settings (``object_fields``), whose copies then compare equal to it until it is
    changed in place."""
    if depth > 8:
        return False
    if isinstance(value, _IMMUTABLE):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(plain_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(plain_value(k, depth + 1) and plain_value(v, depth + 1) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(plain_value(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    if plain_object(value):
        return all(plain_value(v, depth + 1) for v in vars(value).values())
    return False


def comparable(value):
    """What a recorded value is compared by: a copy of a mutable value made of plain ones (a
    list, a dict, a config dataclass: changed in place, it no longer equals its copy; an object
    that compares by identity, by its fields: ``object_fields.Fields``), else the value itself
    (compared by identity, then equality: a tensor replaced by another is changed, a tensor
    changed in place is read live by the graphs)."""
    if isinstance(value, _IMMUTABLE) or not plain_value(value):
        return value
    try:
        kept = copy.deepcopy(value)
        if (kept == value) is True:
            return kept
    except Exception:
        pass
    if plain_object(value):
        return Fields(value, {k: comparable(v) for k, v in vars(value).items()})
    return value


def _getter(names: tuple[str, ...], absent: tuple[str, ...] = ()) -> Callable[[dict], tuple]:
    """A tuple of those keys of a dict (a ``KeyError`` when one is gone), then of the keys
    ``absent`` (``_MISSING`` while each is)."""
    if not names and not absent:
        return lambda d: ()
    if len(names) == 1:
        name, = names
        present = lambda d: (d[name],)      # noqa: E731
    else:
        present = operator.itemgetter(*names) if names else (lambda d: ())
    if not absent:
        return present
    if len(absent) == 1:
        gone, = absent
        return lambda d: (*present(d), d.get(gone, _MISSING))
    return lambda d: (*present(d), *[d.get(n, _MISSING) for n in absent])


class Shown(str):
    """A state a message names in words, not a value (shown without quotes): an input's
    layout, whether it records gradients."""

    def __repr__(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Change:
    """One attribute that differs from conversion: where, its value then and now."""

    where: str          # "eta", "blocks.0.ttt.chunk_size", "o_proj (its class)"
    then: Any
    now: Any

    def describe(self) -> str:
        now = "deleted" if self.now is _MISSING else f"now {_shown(self.now)}"
        if self.then is _MISSING:
            return (f"`{self.where}` was set on the module since conversion, over its class's, "
                    f"to {_shown(self.now)}")
        return f"`{self.where}` was {_shown(self.then)} at conversion and is {now}"


def _shown(value) -> str:
    if isinstance(value, type):
        return value.__name__
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    if code is not None:
        return f"{getattr(value, '__qualname__', '?')} ({code.co_filename}:{code.co_firstlineno})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class _Watched:
    """One module of a converted layer as it was at conversion."""

    path: tuple[str, ...]       # submodule names from the layer (() for the layer itself)
    kind: type | None           # its class (None for the layer, whose class ttt2la changes)
    names: tuple[str, ...]      # its plain attributes, then those it holds none of (``absent``)
    get: Callable[[dict], tuple]
    values: tuple               # their values (``comparable``; ``_MISSING`` for ``absent``)


@dataclass(frozen=True)
class AttributeGuard:
    """The plain attributes (and submodule classes) of a converted layer at conversion; shared
    by its copies, each of which it checks against its own modules."""

    modules: tuple[_Watched, ...]
    checks: tuple[tuple, ...] = ()     # (path, kind, get, values) per module: the call's check

    @classmethod
    def of(cls, layer: torch.nn.Module,
           shadowed: dict[type, frozenset[str]] | None = None,
           caches: tuple[str, ...] = ()) -> "AttributeGuard":
        """Record ``layer``'s attributes and its submodules' as they are now. ``shadowed``:
        per class, the names the layer's code looks up on it (``global_guard.read_off_classes``)
        — a method, a class constant — which an attribute set on a module since would shadow
        (``Layer.close`` by ``layer.close = f``), and a submodule's ``forward``, which torch
        calls (``layer.proj.forward = f``, as wrappers that patch a module do). ``caches``: the
        attributes its forward fills (``"rotary._cos_cached"``, ``filled_caches``), left out:
        filled or not, the layer computes the same."""
        entries = []
        for path, m in layer.named_modules(remove_duplicate=False):
            names = tuple(n for n in plain_attributes(m)
                          if (f"{path}.{n}" if path else n) not in caches)
            absent = _absent(m, names, bool(path), (shadowed or {}).get(type(m), frozenset()))
            get = _getter(names, absent)
            entries.append(_Watched(tuple(path.split(".")) if path else (),
                                    type(m) if path else None, names + absent, get,
                                    tuple(comparable(v) for v in get(vars(m)))))
        return cls(tuple(entries), tuple((w.path, w.kind, w.get, w.values) for w in entries))

    def changed(self, layer: torch.nn.Module) -> Change | None:
        """The first attribute that differs from conversion (``None`` when none does)."""
        if torch.compiler.is_compiling():
            return self._compiled_changed(layer)
        for i, (path, kind, get, values) in enumerate(self.checks):
            try:
                m = layer
                for name in path:
                    m = m._modules[name]
                if (kind is None or type(m) is kind) and get(m.__dict__) == values:
                    continue
            except Exception:       # a submodule gone, an attribute deleted, a tensor replaced
                pass
            found = _which(layer, self.modules[i])
            if found is not None:
                return found
        return None

    def _compiled_changed(self, layer: torch.nn.Module) -> Change | None:
        """``changed`` as TorchDynamo traces it: each attribute read by name, which Dynamo
        guards, so a compiled graph is compiled again once one changes (tensors by identity:
        comparing their values would be data-dependent)."""
        for w in self.modules:
            m = layer
            for name in w.path:
                m = getattr(m, name, None)
            if not isinstance(m, torch.nn.Module) or w.kind is not None and type(m) is not w.kind:
                return _which(layer, w)
            for name, then in zip(w.names, w.values):
                if then is _MISSING:            # none of its own: shadowing its class's
                    if name in m.__dict__:
                        return _which(layer, w)
                    continue
                now = getattr(m, name, _MISSING)
                if now is then:
                    continue
                if isinstance(then, torch.Tensor) or isinstance(now, torch.Tensor) \
                        or not now == then:
                    return _which(layer, w)
        return None


def _absent(m: torch.nn.Module, names: tuple[str, ...], submodule: bool,
            shadowed: frozenset[str]) -> tuple[str, ...]:
    """The names an attribute set on ``m`` would shadow its class's by: ``shadowed`` and, on a
    submodule, ``forward``; none ``m`` holds already or that is torch's or ttt2la's own."""
    wanted = shadowed | {"forward"} if submodule else shadowed
    return tuple(sorted(n for n in wanted if n not in names and n not in vars(m) and watched(n)))


@torch.compiler.disable
def _which(layer: torch.nn.Module, w: _Watched) -> Change | None:
    """The attribute of the module ``w`` watches that changed, described (``None`` when only
    its class is another by a parametrization registered since, which ``recast`` takes)."""
    prefix = ".".join(w.path)
    m = layer
    for name in w.path:
        m = getattr(m, "_modules", {}).get(name, _MISSING)
    if not isinstance(m, torch.nn.Module):
        return Change(prefix, w.kind, m)
    if w.kind is not None and type(m) is not w.kind and _class(m) is not _class_of(w.kind):
        return Change(f"{prefix} (its class)", w.kind, type(m))
    for name, then in zip(w.names, w.values):
        now = vars(m).get(name, _MISSING)
        if not _same(now, then):
            return Change(f"{prefix}.{name}" if prefix else name, then, now)
    return None


def _same(now, then) -> bool:
    if now is then:
        return True
    try:
        return bool(now == then)
    except Exception:
        return False


def _class(m: torch.nn.Module) -> type:
    """A submodule's class, the class a parametrization derives from for a parametrized one
    (registering one renames the weights, for which the layer is converted again: ``recast``)."""
    return _class_of(type(m)) if parametrize.is_parametrized(m) else type(m)


def _class_of(cls: type) -> type:
    """The class a parametrized module's class was derived from (``cls`` for any other)."""
    return cls.__bases__[0] if cls.__module__ == parametrize.__name__ else cls


__all__ = ["AttributeGuard", "Change", "Shown", "BOOKKEEPING", "comparable", "plain_attributes",
           "plain_value", "watched"]
