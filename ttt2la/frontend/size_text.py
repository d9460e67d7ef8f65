"""Text made of a value of the call's sizes, a decision of the run of ``size_uses``.

``f"mask_{T}"``, ``str(T)``, ``repr(x.shape)``, ``hex(T)``: text leaves the run untracked, and
code that compares it, looks it up (a cache keyed by ``f"mask_{T}"``) or cuts it
(``f"{T}".endswith("6")``) would be converted with the probe lengths' outcome at every length.
Turning a ``SizeInt`` or a ``SizeFloat`` into text at a user line is recorded as a decision of the
text itself, which changes with the size: conservatively, the converted layer checks each new
length against the code as written (exact levels) or refuses it (lossy ones). Text a statement
only prints or logs (``print(f"T={T}")``, ``logger.info(...)``, ``warnings.warn(...)``) leaves
the program and is no decision, as a guard that only raises is none.
"""
from __future__ import annotations

import ast
import builtins
import functools
import sys

from .size_uses import _RUN, SizeFloat, SizeInt, _library, _plain
from .user_code import parsed

#: what a statement calls that only prints or logs its arguments
_OUTPUTS = frozenset({"print", "warn", "debug", "info", "warning", "error", "exception",
                      "critical", "log"})


def made_text(depth: int, at) -> None:
    """Record the text ``at(L, B)`` made at the line of the frame ``depth`` levels above the
    caller, where it is the user's and does more than print it."""
    run = _RUN[0]
    if run is None:
        return
    frame = sys._getframe(depth + 1)
    file = frame.f_code.co_filename
    if _library(file) or _printed(file, frame.f_lineno):
        return
    run.record(frame, "makes text of", at)


@functools.lru_cache(maxsize=1024)
def _printed(file: str, line: int) -> bool:
    """Is every statement at ``file:line`` a call that only prints or logs (``print(...)``,
    ``logger.debug(...)``, ``warnings.warn(...)``), its value unused? A compound statement's
    header there (``if f"{T}" in seen: print(T)``) is a decision."""
    tree = parsed(file)
    found = False
    for node in ast.walk(tree) if tree is not None else ():
        if not isinstance(node, ast.stmt) or not node.lineno <= line <= (node.end_lineno or 0):
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            if line == node.lineno or line < body[0].lineno:
                return False
            continue
        call = node.value if isinstance(node, ast.Expr) else None
        f = getattr(call, "func", None)
        if not isinstance(call, ast.Call) or \
                getattr(f, "attr", getattr(f, "id", "")) not in _OUTPUTS:
            return False
        found = True
    return found


def _formatted(self, spec: str = "") -> str:
    f = self.at
    made_text(1, lambda L, B: format(f(L, B), spec))
    return format(_plain(self), spec)


def _str(self) -> str:
    f = self.at
    made_text(1, lambda L, B: str(f(L, B)))
    return str(_plain(self))


def _repr(self) -> str:
    f = self.at
    made_text(1, lambda L, B: repr(f(L, B)))
    return repr(_plain(self))


def _to_bytes(self, *args, **kwargs) -> bytes:
    f = self.at
    made_text(1, lambda L, B: int(f(L, B)).to_bytes(*args, **kwargs))
    return _plain(self).to_bytes(*args, **kwargs)


def _hex(self) -> str:
    f = self.at
    made_text(1, lambda L, B: float(f(L, B)).hex())
    return _plain(self).hex()


def digits(base: str):
    """``hex``, ``oct`` or ``bin`` (``base``) to the user's modules during the run: the text of
    a value of the sizes is a decision (CPython reads an ``int`` subclass's value without a
    method of it that could tell)."""
    builtin = getattr(builtins, base)

    @functools.wraps(builtin)
    def call(n):
        if isinstance(n, SizeInt):
            f = n.at
            made_text(1, lambda L, B: builtin(f(L, B)))
        return builtin(n)
    return call


for _cls in (SizeInt, SizeFloat):
    _cls.__format__, _cls.__str__, _cls.__repr__ = _formatted, _str, _repr
SizeInt.to_bytes = _to_bytes
SizeFloat.hex = _hex


__all__ = ["made_text", "digits"]
