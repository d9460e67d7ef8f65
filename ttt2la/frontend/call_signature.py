"""What a converted layer was converted for: the inputs of its example call, checked on every call.

A converted layer runs graphs traced on its example call: one input per leaf of that call's
arguments, every tensor of the example's rank, every size that is neither the batch nor the
sequence fixed, every other value (``h``, ``w``, a flag) baked in. A call that differs — an
optional mask passed or left out, a tensor of another rank or width, another ``h`` — would fail
deep inside a graph with a raw exception, or silently use the baked-in value. ``CallSignature``
answers it first, with an ``UnsupportedShapeError`` naming the input and saying what to pass.

A call means what it means to the layer's ``forward``: its arguments are bound to the forward's
parameters by name (``spelled``), so a keyword is never taken for the one the example passed in
its place, keywords may come in any order, an argument may be passed by position or by keyword,
and one the example left out may be passed at its default; a dict inside an argument is read by
its keys, in any order. The call is then spelled as the example was — its inputs in the order
the graphs take them — and each argument must be built as the example's was (a tensor wrapped
in a list flattens to the same inputs, but the layer's code reads it otherwise) before it is
checked leaf by leaf.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from ..errors import UnsupportedShapeError
from ..original_class import original_class
from ..validation import input_name

#: how many inputs a message lists before it stops
_SHOWN = 8
#: how many spellings of a call a signature keeps the binding of
_PLANS = 64
#: leaves of every pytree, told without asking its registry (plain tensors and parameters)
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


@dataclass(frozen=True)
class Leaf:
    """One input of the example call: a tensor's rank and fixed sizes, or a baked-in value."""

    name: str                           # "#0" (positional) or "'store_mask'" (keyword)
    rank: int | None = None             # None: not a tensor
    shape: tuple = ()                   # the example's sizes
    value: object = None                # a non-tensor input's value

    def describe(self, batch_axis: int | None, token_axis: int | None) -> str:
        if self.rank is None:
            return f"{self.name} = {self.value!r}"
        dims = ["B" if a == batch_axis else "L" if a == token_axis else str(n)
                for a, n in enumerate(self.shape)]
        return f"{self.name}: a tensor [{', '.join(dims)}]"


class _Shown:
    """A leaf of the example call in its place in the example's structure."""

    __slots__ = ("leaf",)

    def __init__(self, leaf: "Leaf") -> None:
        self.leaf = leaf


def _built(x) -> str:
    """How an argument is built: a tensor, a value, or a container and what it holds."""
    if isinstance(x, _Shown):
        return "a tensor" if x.leaf.rank is not None else repr(x.leaf.value)
    if pytree.tree_is_leaf(x):
        return "a tensor" if isinstance(x, torch.Tensor) else repr(x)
    if isinstance(x, dict):
        return f"a {type(x).__name__} {{" + ", ".join(f"{k!r}: {_built(v)}"
                                                  for k, v in x.items()) + "}"
    return f"a {type(x).__name__} [" + ", ".join(_built(v) for v in x) + "]"


class OtherValueError(UnsupportedShapeError):
    """A call giving a plain Python argument the example left at its default another value,
    which the conversion built into its graphs; ``which`` describes it, for an exact
    conversion's run of the code as written (a lossy one raises it)."""

    def __init__(self, message: str, which: str):
        super().__init__(message)
        self.which = which


def _same_value(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:               # a value whose == is not a bool
        return False


def _concrete(x):
    """A plain number as Python's own type: under ``torch.compile`` a float argument is a
    traced value, which TorchDynamo cannot format into a string."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x
    return float(x) if isinstance(x, float) else int(x)


class _From:
    """A stand-in bound in a call's place: ``(0, i)``, its ``i``-th positional argument, or
    ``(1, key)``, its keyword argument ``key``."""

    __slots__ = ("source",)

    def __init__(self, source: tuple) -> None:
        self.source = source


def _pick(source: tuple, args: tuple, kwargs: dict):
    """The value ``source`` names in the call: a positional argument, a keyword argument or
    (``(2, value)``) a parameter's default."""
    kind, at = source
    return args[at] if kind == 0 else kwargs[at] if kind == 1 else at


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

#: each class's forward signature, without ``self`` (``None`` where it cannot bind a call)
_SIGNATURES: "weakref.WeakKeyDictionary[type, inspect.Signature | None]" = \
    weakref.WeakKeyDictionary()


def forward_signature(cls: type) -> inspect.Signature | None:
    """The signature calls of ``cls`` bind to (its ``forward`` without ``self``), or ``None``
    where it has none that can (a builtin, a forward taking ``self`` in ``*args``)."""
    cls = original_class(cls)                             # the user's class, if converted
    try:
        return _SIGNATURES[cls]
    except KeyError:
        pass
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
        sig = inspect.Signature(params[1:]) if params and params[0].kind in _POSITIONAL \
            else None
    except (TypeError, ValueError, AttributeError):
        sig = None
    _SIGNATURES[cls] = sig
    return sig


def _slots(sig: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """Where each argument of the call ``(args, kwargs)`` binds in ``sig``: ``(name,)`` for a
    parameter, ``(name, i)`` for the ``i``-th value of ``*name``, ``(name, key)`` for ``key``
    of ``**name``. Raises ``TypeError`` where the call does not bind."""
    sig.bind(*args, **kwargs)
    params = list(sig.parameters.values())
    named = [p.name for p in params if p.kind in _POSITIONAL]
    var = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    varkw = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    positional = tuple((named[i],) if i < len(named) else (var, i - len(named))
                       for i in range(len(args)))
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keyword = tuple((k,) if k in sig.parameters and sig.parameters[k].kind in by_name
                    else (varkw, k) for k in kwargs)
    return positional, keyword


@dataclass(frozen=True, eq=False)
class CallSignature:
    """The leaves of the example call, in the order the converted layer's graphs take them;
    how the example spelled its arguments (``positional`` of them by position, then
    ``keywords`` in their order) and, where the forward's signature binds calls, where each
    of them binds (``slots``) and the value the example gave every other parameter
    (``others``: its default)."""

    leaves: tuple[Leaf, ...]
    positional: int = 0
    keywords: tuple[str, ...] = ()
    binding: inspect.Signature | None = None
    slots: tuple = ()
    others: tuple = ()                  # (name, the example's value) of the parameters left out
    nested: tuple = ()                  # the leaves' key paths, where a dict sits in an argument
    spec: pytree.TreeSpec | None = None     # the example's structure, where ``nested``
    structure: pytree.TreeSpec | None = None    # the example's structure, where an argument
    #                                             is a container (a list, a tuple, a dict)
    _plans: dict = field(default_factory=dict, repr=False)   # spelling -> ``_plan``

    @classmethod
    def of(cls, args: tuple, kwargs: dict, module: torch.nn.Module | None = None
           ) -> "CallSignature":
        leaves = []
        flat, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
        paths = tuple(path for path, _ in flat)
        nested = paths if any(isinstance(k, pytree.MappingKey) for path in paths
                              for k in path[2:]) else ()
        for path, x in flat:
            if isinstance(x, torch.Tensor):
                leaves.append(Leaf(input_name(path, "input"), x.dim(), tuple(x.shape)))
            else:
                leaves.append(Leaf(input_name(path, "input"), value=x))
        sig = None if module is None else forward_signature(type(module))
        slots, others = (), ()
        if sig is not None:
            try:
                positional, keyword = _slots(sig, tuple(args), dict(kwargs))
                bound = sig.bind(*args, **kwargs)
            except TypeError:           # the signature says otherwise than the call that ran
                sig = None
            else:
                bound.apply_defaults()
                slots = positional + keyword
                given = {s[0] for s in slots}
                others = tuple((name, bound.arguments[name]) for name in sig.parameters
                               if name not in given)
        containers = not all(pytree.tree_is_leaf(a) for a in (*args, *kwargs.values()))
        return cls(tuple(leaves), len(args), tuple(kwargs), sig, slots, others, nested,
                   spec if nested else None, spec if containers else None)

    def as_given(self, args: tuple, kwargs: dict) -> bool:
        """Is a call of tensors ``(args, kwargs)`` spelled as the example was, so that
        ``spelled`` hands it back as it is?"""
        return not kwargs and not self.keywords and len(args) == self.positional \
            and not self.nested

    def spelled(self, args: tuple, kwargs: dict, batch_axis: dict, token_axis: dict,
                path: str = "") -> tuple[tuple, dict]:
        """The call ``(args, kwargs)`` spelled as the example was: each argument bound to the
        parameter it means by the forward's signature, its keywords matched by name (never by
        position), in the example's order. Raises ``UnsupportedShapeError`` naming the
        argument where the call passes one the example did not, leaves out one it passed, or
        gives a parameter the example left out another value than its default."""
        if len(args) == self.positional and tuple(kwargs) == self.keywords:
            # the example's own spelling: nothing to bind
            return self._as_structured(*(self._keys_as_example(args, kwargs, batch_axis,
                                                               token_axis, path)
                                         if self.nested else (args, kwargs)),
                                       batch_axis, token_axis, path)
        key = (len(args), tuple(kwargs))
        plan = self._plans.get(key)
        if plan is None:                # binding depends on the spelling, not on the values
            plan = self._plan(*key)
            if len(self._plans) < _PLANS:
                self._plans[key] = plan
        problem, sources, checks = plan
        which = ""
        if not problem:
            for source, name, then in checks:   # left out by the example: at its default
                now = _pick(source, args, kwargs)
                if not (now is then or not isinstance(now, torch.Tensor)
                        and _same_value(now, then)):
                    shown = "a tensor" if isinstance(now, torch.Tensor) else repr(now)
                    problem = (f"{name!r} = {shown}, but it was converted with {name!r} left at "
                               f"its default {then!r}, which is built into the converted graphs")
                    if not isinstance(now, torch.Tensor):
                        which = f"{name!r} = {shown}, where it was converted with its " \
                                f"default {then!r}"
                    break
        if problem:
            message = (f"the converted {path or 'layer'} was called with {problem}. It was "
                       f"converted for calls with {self.describe(batch_axis, token_axis)}; call "
                       "it that way, or convert it again with example inputs like this call's.")
            raise OtherValueError(message, which) if which else UnsupportedShapeError(message)
        values = [_pick(source, args, kwargs) for source in sources]
        n = self.positional
        args, kwargs = tuple(values[:n]), dict(zip(self.keywords, values[n:]))
        return self._as_structured(*(self._keys_as_example(args, kwargs, batch_axis, token_axis,
                                                           path)
                                     if self.nested else (args, kwargs)),
                                   batch_axis, token_axis, path)

    def _as_structured(self, args: tuple, kwargs: dict, batch_axis: dict, token_axis: dict,
                       path: str) -> tuple[tuple, dict]:
        """``(args, kwargs)``, spelled as the example, when each argument is built as the
        example's was (a tensor, a value, or a container of as many of them); raises
        ``UnsupportedShapeError`` naming the argument where it is not. The converted graphs
        take the call's inputs flattened: a tensor wrapped in a list, or two lists swapped for
        one, flattens to the example's inputs although the layer's forward reads them otherwise
        (``x.shape`` of a list fails in the code as written)."""
        if self.structure is None:      # the example's arguments are tensors and values
            if all(type(a) in _TENSORS or pytree.tree_is_leaf(a) for a in args) and \
                    all(type(v) in _TENSORS or pytree.tree_is_leaf(v) for v in kwargs.values()):
                return args, kwargs
        elif pytree.tree_structure((tuple(args), dict(kwargs))) == self.structure:
            return args, kwargs
        shown = [_Shown(leaf) for leaf in self.leaves]
        n = self.positional
        ex_args, ex_kwargs = pytree.tree_unflatten(shown, self.structure) \
            if self.structure is not None else \
            (tuple(shown[:n]), dict(zip(self.keywords, shown[n:])))
        found = "arguments built otherwise than the example's"
        for name, now, then in [*((f"#{i}", a, b) for i, (a, b) in enumerate(zip(args, ex_args))),
                                *((repr(k), v, ex_kwargs.get(k)) for k, v in kwargs.items())]:
            if pytree.tree_structure(now) != pytree.tree_structure(then):
                found = f"{name} = {_built(now)}, where the call it was converted from passed " \
                    f"{_built(then)}"
                break
        raise UnsupportedShapeError(
            f"the converted {path or 'layer'} was called with {found}. It was converted for "
            f"calls with {self.describe(batch_axis, token_axis)}; call it that way, or convert "
            "it again with example inputs like this call's.")

    def _keys_as_example(self, args: tuple, kwargs: dict, batch_axis: dict, token_axis: dict,
                         path: str) -> tuple[tuple, dict]:
        """The call's dicts with their keys in the example's order, so that its flattened
        inputs are the graphs' by key, not by position; raises ``UnsupportedShapeError``
        naming the keys where the call's dicts hold others than the example's."""
        flat = dict(pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0])
        if flat.keys() != set(self.nested):
            missing = [input_name(p, "input") for p in self.nested if p not in flat]
            extra = [input_name(p, "input") for p in flat if p not in set(self.nested)]
            said = "; ".join(filter(None, (
                f"no {', '.join(missing[:_SHOWN])}" if missing else "",
                f"{', '.join(extra[:_SHOWN])}, which the example did not pass" if extra
                else "")))
            raise UnsupportedShapeError(
                f"the converted {path or 'layer'} was called with {said}. It was converted for "
                f"calls with {self.describe(batch_axis, token_axis)}; call it that way, or "
                "convert it again with example inputs like this call's.")
        return pytree.tree_unflatten([flat[p] for p in self.nested], self.spec)

    def _plan(self, n_args: int, keywords: tuple) -> tuple[str, tuple, tuple]:
        """How a call of ``n_args`` positional arguments and ``keywords`` is spelled as the
        example: ``(problem, sources, checks)`` — what it passes that the example's spelling
        cannot take ("" when nothing), where each of the example's arguments comes from, and
        the parameters the example left out that it passes (each with the example's value)."""
        if self.binding is None:        # positional inputs as given; keywords by name
            if n_args != self.positional:
                return (f"{n_args} positional argument(s), where the call it was converted from "
                        f"passed {self.positional}"), (), ()
            for k in keywords:
                if k not in self.keywords:
                    return (f"the keyword argument {k!r}, which the call it was converted from "
                            "did not pass"), (), ()
            for k in self.keywords:
                if k not in keywords:
                    return (f"no keyword argument {k!r}, which the call it was converted from "
                            "passed"), (), ()
            return "", tuple((0, i) for i in range(n_args)) + tuple((1, k) for k in
                                                                   self.keywords), ()
        # bind stand-ins: each parameter's value says where the call passes it from
        try:
            bound = self.binding.bind(*(_From((0, i)) for i in range(n_args)),
                                      **{k: _From((1, k)) for k in keywords})
        except TypeError as e:
            return f"arguments its forward does not take ({e})", (), ()
        bound.apply_defaults()
        got = bound.arguments
        sources = []
        for slot in self.slots:
            if len(slot) == 1:
                value = got[slot[0]]
            else:                       # a value of ``*name`` or ``**name``
                name, at = slot
                held = got[name]
                if not (at in held if isinstance(at, str) else at < len(held)):
                    thing = f"keyword argument {at!r} (**{name})" if isinstance(at, str) else \
                        f"positional argument #{at} of *{name}"
                    return f"no {thing}, which the call it was converted from passed", (), ()
                value = held[at]
            sources.append(value.source if isinstance(value, _From) else (2, value))
        checks = []
        for name, then in self.others:
            kind = self.binding.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL or \
                    kind is inspect.Parameter.VAR_KEYWORD:
                continue
            if isinstance(got[name], _From):    # else its default, as in the example
                checks.append((got[name].source, name, then))
        for p in self.binding.parameters.values():
            used = [s[1] for s in self.slots if len(s) == 2 and s[0] == p.name]
            held = got.get(p.name, ())
            if p.kind is inspect.Parameter.VAR_POSITIONAL and len(held) > len(used):
                return (f"{len(held) - len(used)} more positional argument(s) (*{p.name}) than "
                        "the call it was converted from"), (), ()
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                for k in held:
                    if k not in used:
                        return (f"the keyword argument {k!r} (**{p.name}), which the call it "
                                "was converted from did not pass"), (), ()
        return "", tuple(sources), tuple(checks)

    def describe(self, batch_axis: dict, token_axis: dict) -> str:
        shown = [leaf.describe(batch_axis.get(i), token_axis.get(i))
                 for i, leaf in enumerate(self.leaves[:_SHOWN])]
        more = len(self.leaves) - _SHOWN
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")

    def other_values(self, flat: list) -> str:
        """The call's first plain Python argument (such as ``h, w``) whose value is not the
        example's, which the conversion built into its graphs, described; ``""`` where every
        one is the example's (or the call has other inputs than the example's)."""
        if len(flat) != len(self.leaves):
            return ""
        for leaf, x in zip(self.leaves, flat):
            if leaf.rank is None and not isinstance(x, torch.Tensor) \
                    and not _same_value(x, leaf.value):
                return f"{leaf.name} = {_concrete(x)!r}, where it was converted with " \
                    f"{leaf.value!r}"
        return ""

    def check(self, flat: list, batch_axis: dict, token_axis: dict, ref: int,
              path: str) -> None:
        """Raise ``UnsupportedShapeError`` when ``flat`` (a call's inputs, flattened) is not a
        call the converted layer's graphs can run."""
        what = f"the converted {path or 'layer'}"

        def tail() -> str:          # built only for a message
            return (f"It was converted for calls with {self.describe(batch_axis, token_axis)}; "
                    "call it that way, or convert it again with example inputs like this call's.")

        if len(flat) != len(self.leaves):
            raise UnsupportedShapeError(
                f"{what} was called with {len(flat)} input(s) (its arguments' tensors and values, "
                f"containers' contents included), but it was converted for {len(self.leaves)}. "
                f"{tail()}")
        B = L = None
        x = flat[ref]
        if isinstance(x, torch.Tensor) and x.dim() == self.leaves[ref].rank:
            B = x.shape[batch_axis[ref]]
            L = x.shape[token_axis[ref]] if ref in token_axis else None
        for i, (leaf, x) in enumerate(zip(self.leaves, flat)):
            problem = self._problem(leaf, x, batch_axis.get(i), token_axis.get(i), B, L)
            if problem:
                raise UnsupportedShapeError(f"{what} was called with {leaf.name} {problem}. "
                                            f"{tail()}")

    @staticmethod
    def _problem(leaf: Leaf, x, b_axis, t_axis, B, L) -> str:
        """What is wrong with input ``x`` where ``leaf`` was given ('' when nothing is)."""
        if leaf.rank is None:
            if isinstance(x, torch.Tensor) or not _same_value(x, leaf.value):
                shown = "a tensor" if isinstance(x, torch.Tensor) else repr(x)
                return (f"= {shown}, but the value {leaf.value!r} it was converted with is "
                        "built into the converted graphs")
            return ""
        if not isinstance(x, torch.Tensor):
            return f"= {type(x).__name__ if x is not None else 'None'}, not a tensor"
        if x.dim() != leaf.rank:
            return f"of shape {tuple(x.shape)}: {x.dim()} axes, not {leaf.rank}"
        for a, (n, n0) in enumerate(zip(x.shape, leaf.shape)):
            if a == b_axis:
                if B is not None and n != B:
                    return f"of shape {tuple(x.shape)}: batch {n}, but the call's batch is {B}"
            elif a == t_axis:
                if L is not None and n != L:
                    return f"of shape {tuple(x.shape)}: {n} tokens, but the call has {L}"
            elif n != n0:
                return f"of shape {tuple(x.shape)}: axis {a} has size {n}, not {n0}"
        return ""


__all__ = ["CallSignature", "Leaf", "OtherValueError", "forward_signature"]
