"""Attributes a layer's forward assigns on itself, which a converted layer would not assign.

A converted layer computes its output from its graphs and never runs the layer's Python, so a
forward that also stores something on ``self`` — the final fast weights as a decoding cache, the
inner loss for logging, a call counter — would lose that write: the attribute would keep the
value it had at conversion, and code reading it (a forward continuing from ``self.cache``)
would silently compute something else. ``run_written`` runs the layer once and compares its
attributes, and its submodules', before and after (plain values by value, containers changed in
place included; tensors and other objects by identity: a cache of the same shape written again
is still a write); ``filled_caches.settle_start`` tells the caches among the writes from the
rest, and ``refusal`` names each other write, with the line that makes it where the source
shows it, and what to do instead. In-place updates of buffers are no such write: the converted
graphs make them.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import torch

from .attribute_guard import comparable, plain_attributes, plain_value

_GONE = object()


def _snapshot(module: torch.nn.Module) -> dict[tuple[str, str], tuple]:
    """``{(submodule path, attribute): (value, comparable value)}`` for every plain attribute,
    buffer and parameter of ``module`` and its submodules."""
    seen = {}
    for path, m in module.named_modules(remove_duplicate=False):
        held = {**plain_attributes(m), **m._buffers, **m._parameters}
        for name, value in held.items():
            seen[(path, name)] = (value, comparable(value))
    return seen


def run_written(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[object, list[str]]:
    """One eager call of ``module``'s forward (not its own hooks: they run on a converted
    layer), without gradients and with the random generators restored: what it returns and the
    attributes it assigned. Raises what the call raises."""
    before = _snapshot(module)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), \
            torch.compiler.set_stance("force_eager"):
        out = module.forward(*args, **kwargs)
    after = _snapshot(module)
    written = []
    for key in {**before, **after}:
        (was, was_kept), (now, _) = before.get(key, (_GONE, _GONE)), after.get(key, (_GONE, _GONE))
        if now is was and (was_kept is was or _equal(now, was_kept)) or \
                plain_value(now) and plain_value(was) and _equal(now, was_kept):
            continue        # the same object, or a plain value written again unchanged
        path, name = key
        written.append(f"{path}.{name}" if path else name)
    return out, written


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def refusal(layer_name: str, module: torch.nn.Module, written: list[str],
            once: bool = False) -> str:
    """Why a layer whose forward assigns ``written`` is not converted, and what to do
    (``once``: it assigns them at its first call only, and computes another function after)."""
    where = assignment_site(module, written[0])
    shown = ", ".join(f"`self.{w}`" for w in written[:3]) + \
        (f" and {len(written) - 3} more" if len(written) > 3 else "")
    if once:
        return (f"{layer_name} sets {shown} at its first call"
                + (f" ({where})" if where else "")
                + ", and its outputs depend on that value at later calls of other lengths: it "
                "computes one function at its first call and another after. A converted layer "
                "computes one of them. Call the layer once as you will first call it, then "
                "convert it: it is converted for the value it then holds.")
    return (f"{layer_name} assigns {shown} in its forward"
            + (f" ({where})" if where else "")
            + ". A converted layer computes its output from its own graphs and would not make "
            "that write: the attribute would keep its value from conversion, and code reading "
            "it would see that. Return the value from forward instead (`return y, W`) and keep "
            "it where you call the layer, or leave this layer unconverted: in a model whose "
            "other layers convert, it runs as written and the report's notes name it.")


def assignment_site(module: torch.nn.Module, written: str) -> str:
    """``"file.py:21 (`self.cache = W.detach()`)"``: the first statement outside ``__init__`` of
    the layer's classes that assigns ``self.<written>`` (or, for a submodule's attribute, of
    the submodule's class assigning ``self.<name>``); "" where the source does not show it."""
    *path, name = written.split(".")
    owners = [(module, written)]
    if path:
        owners.append((module.get_submodule(".".join(path)), name))
    for owner, dotted in owners:
        for cls in type(owner).__mro__:
            if cls.__module__.startswith("torch.") or cls is object:
                continue
            found = _site_in(cls, dotted)
            if found:
                return found
    return ""


def _site_in(cls: type, dotted: str) -> str:
    """Where a method of ``cls`` other than ``__init__`` assigns ``<self>.<dotted>``."""
    for method, name, _node, where in self_assignments(cls):
        if method != "__init__" and name == dotted:
            return where
    return ""


def self_assignments(cls: type) -> list[tuple[str, str, ast.AST, str]]:
    """``(method, dotted name, statement, "file.py:line (`code`)")`` for every statement of
    ``cls``'s own methods that assigns an attribute of the instance (``self.cache = ...``,
    ``self.q.last = ...``), in source order; none where the source does not show them."""
    try:
        lines, start = inspect.getsourcelines(cls)
        file = inspect.getsourcefile(cls) or "?"
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            continue
        this = fn.args.args[0].arg
        for node in ast.walk(fn):
            for target in _targets(node):
                name = _names(target, this)
                if name is not None:
                    where = (f"{file.rsplit('/', 1)[-1]}:{start + node.lineno - 1} "
                             f"(`{lines[node.lineno - 1].strip()}`)")
                    found.append((fn.name, name, node, where))
    return found


def _targets(node: ast.AST) -> list[ast.expr]:
    """What a statement assigns: its targets (tuples unpacked), or ``setattr``'s first two
    arguments as an attribute."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "setattr" and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return [ast.Attribute(value=node.args[0], attr=node.args[1].value)]
    else:
        return []
    flat = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        else:
            flat.append(t)
    return flat


def _names(target: ast.expr, this: str) -> str | None:
    """``"q.last"`` for ``self.q.last`` (``this`` naming the instance), else None."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    if isinstance(target, ast.Name) and target.id == this and parts:
        return ".".join(reversed(parts))
    return None


#: Methods that change a list, dict or set in place (``CALLS.append(1)``).
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update",
                       "setdefault", "add", "discard", "__setitem__", "popitem"})


def written_while_converting(model: torch.nn.Module, error) -> Exception:
    """The ``SideEffectError`` for a global or class attribute (``error``, a
    ``ChangedAttributeError`` raised while ``convert`` ran the layer, when nothing else could
    change it) that the layer's own forward writes: a call counter, a log."""
    from .errors import SideEffectError

    what = error.attribute or "a value the layer reads"
    dotted = what.split(" (", 1)[0]
    where = _outside_write(model, dotted)
    return SideEffectError(
        f"{what} changed from {error.then!r} to {error.now!r} while ttt2la ran the layer's "
        f"forward during conversion: the forward writes it"
        + (f" ({where})" if where else "")
        + ". A converted layer computes its output from its own graphs and would not make that "
        "write, and reads the value it was converted with. Move the write out of forward (a "
        "forward hook on the layer still runs on a converted layer), or leave this layer "
        "unconverted.", attribute=dotted, where=where or None)


def _outside_write(model: torch.nn.Module, dotted: str) -> str:
    """``"file.py:17 (`CALLS[0] += 1`)"``: the first statement of the model's classes that
    writes ``dotted`` (a global ``CALLS`` or a class attribute ``Layer.calls``) or changes it in
    place; "" where the source does not show one."""
    parts = dotted.split(".")
    for cls in dict.fromkeys(c for m in model.modules() for c in type(m).__mro__):
        if cls.__module__.startswith(("torch.", "ttt2la.", "builtins")):
            continue
        try:
            lines, start = inspect.getsourcelines(cls)
            file = inspect.getsourcefile(cls) or "?"
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = _targets(node)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _MUTATORS:
                targets = [node.func.value]
            if any(_rooted_at(t, parts) for t in targets):
                return (f"{file.rsplit('/', 1)[-1]}:{start + node.lineno - 1} "
                        f"(`{lines[node.lineno - 1].strip()}`)")
    return ""


def _rooted_at(target: ast.expr, parts: list[str]) -> bool:
    """Whether ``target`` is ``parts`` joined by dots, or an item or attribute of it."""
    chain = []
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        if isinstance(target, ast.Attribute):
            chain.append(target.attr)
        else:
            chain.clear()               # an item of what comes before
        target = target.value
    if not isinstance(target, ast.Name):
        return False
    names = [target.id, *reversed(chain)]
    return names[:len(parts)] == parts


__all__ = ["run_written", "assignment_site", "refusal", "self_assignments",
           "written_while_converting"]
