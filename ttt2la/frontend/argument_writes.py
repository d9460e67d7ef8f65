"""Writes a layer's forward makes into the objects passed to it, which a converted layer would not.

ttt-lm-pytorch's layers store their final fast weights in a cache object the model passes on
every call (``cache_params.params["W1"] = W``), and Hugging Face-style code fills a
``past_key_values`` dict or appends to a list it is handed. A converted layer computes its output
from its graphs and never runs that code, so the write would be lost — the cache would stay as it
was, and decoding from it would silently restart — and every later run of the layer during the
conversion itself would start from what the first run wrote. ``Structure`` records what can be
seen of a call's arguments (the keys of dicts, the lengths of lists, the fields of plain objects,
the identity and version of every tensor inside them, the plain values) before the module runs
and after; ``changed`` names what the call changed, for ``refusal`` to say.
"""
from __future__ import annotations

import types

import torch

_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_DEPTH = 12
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)


class Structure:
    """What can be seen of ``(args, kwargs)`` of one call, by the path that reaches it."""

    def __init__(self, args: tuple, kwargs: dict):
        self.seen: dict[str, object] = {}
        with torch._C.DisableTorchFunction():     # unseen by a mode recording the call's ops
            for i, a in enumerate(args):
                self._walk(a, f"argument {i}", 0, set())
            for k, v in kwargs.items():
                self._walk(v, f"`{k}`", 0, set())

    def _walk(self, value, path: str, depth: int, visiting: set) -> None:
        if isinstance(value, torch.Tensor):
            if depth > 0:       # a tensor argument itself is the layer's input, read not kept
                self.seen[path] = ("tensor", id(value), value._version)
            return
        if isinstance(value, _PLAIN):
            self.seen[path] = ("value", value)
            return
        if depth >= _DEPTH or id(value) in visiting or isinstance(value, torch.nn.Module):
            return
        visiting = visiting | {id(value)}
        if isinstance(value, dict):
            self.seen[path] = ("dict", tuple(map(repr, value)))
            for k, v in list(value.items()):
                self._walk(v, f"{path}[{k!r}]", depth + 1, visiting)
        elif isinstance(value, (list, tuple)):
            self.seen[path] = (type(value).__name__, len(value))
            for i, v in enumerate(list(value)):
                self._walk(v, f"{path}[{i}]", depth + 1, visiting)
        elif not isinstance(value, _CODE):
            fields = _fields(value)
            self.seen[path] = ("object", tuple(fields))
            for k, v in fields.items():
                self._walk(v, f"{path}.{k}", depth + 1, visiting)

    def changed(self, after: "Structure") -> list[str]:
        """The paths whose seen value ``after`` differs, outermost first (a dict that gained a
        key, not also the key itself)."""
        out = []
        for path in sorted(self.seen.keys() | after.seen.keys(), key=len):
            if self.seen.get(path) != after.seen.get(path) and \
                    not any(path.startswith(done) for done in out):
                out.append(path)
        return out


def _fields(value) -> dict:
    """An object's fields: its ``__dict__`` and the ``__slots__`` of its classes that are set."""
    fields = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                fields[name] = getattr(value, name)
    return fields


def refusal(layer: str, changed: list[str]) -> str:
    """Why a layer whose forward changes ``changed`` among its arguments is not converted."""
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (f"{layer} writes into the arguments it is called with ({shown} changed during its "
            "forward): a converted layer computes its output from its own graphs and would not "
            "make that write, so code reading the argument after the call (a decoding cache) "
            "would see it as it was. Return the value from forward instead (`return y, W`) and "
            "store it where you call the layer, or leave this layer unconverted: in a model "
            "whose other layers convert, it runs as written and the report's notes name it.")


__all__ = ["Structure", "refusal"]
