"""The user's code as files: which are the user's, and their source, parsed.

The source readings (``length_values``, ``loop_source``), the run that follows the call's sizes
(``size_uses``), the guard of values read from outside a layer (``global_guard``) and the naming
of a call's line (``call_variation``) each ask the same two things of a file: is it the user's
code — not torch's, the standard library's, an installed package's or ttt2la's own, whose zoo
of example layers is written as users write theirs — and what does it say.
"""
from __future__ import annotations

import ast
import functools
import linecache
import os
import sys

#: ttt2la's own source, and its zoo of example layers within it (user code)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
ZOO_DIR = PACKAGE_DIR + "zoo" + os.sep


@functools.lru_cache(maxsize=4096)
def real_path(path: str) -> str:
    return os.path.realpath(path)


@functools.lru_cache(maxsize=1)
def library_roots() -> tuple[str, ...]:
    """Where torch, the standard library and installed packages live: code no layer's author
    wrote."""
    import sysconfig

    import torch
    roots = {os.path.dirname(os.path.realpath(torch.__file__)),
             os.path.realpath(sysconfig.get_paths()["stdlib"])}
    roots |= {os.path.realpath(p) for p in sys.path if p.rstrip("/").endswith(
        ("site-packages", "dist-packages")) or _holds_distributions(p)}
    return tuple(r + os.sep for r in roots)


def _holds_distributions(path: str) -> bool:
    """Whether ``path`` holds installed packages' records (``*.dist-info``): a directory pip
    installed into with ``--target``, or one put on ``PYTHONPATH`` (a source tree installed in
    development mode keeps its records elsewhere)."""
    try:
        return any(name.endswith(".dist-info") for name in os.listdir(path or "."))
    except OSError:
        return False


@functools.lru_cache(maxsize=4096)
def is_users(path: str) -> bool:
    """Is the file at ``path`` the user's code (ttt2la's zoo counts as the user's; of the names
    Python gives code without a file, ``<stdin>``, ``<string>`` and a notebook's cells do)?"""
    if path.startswith("<"):
        return not path.startswith("<frozen")
    real = real_path(path)
    if real.startswith(PACKAGE_DIR):
        return real.startswith(ZOO_DIR)
    return not real.startswith(library_roots())


@functools.lru_cache(maxsize=64)
def parsed(file: str) -> ast.Module | None:
    """The parsed source of ``file`` (``None`` where it cannot be read or parsed)."""
    lines = linecache.getlines(file)
    try:
        return ast.parse("".join(lines)) if lines else None
    except (SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def source_lines(file: str) -> tuple[str, ...]:
    return tuple(line.rstrip("\n") for line in linecache.getlines(file))


@functools.lru_cache(maxsize=256)
def function_at(file: str, line: int) -> ast.FunctionDef | None:
    """The innermost function definition of ``file`` that holds ``line``."""
    tree = parsed(file)
    if tree is None:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


__all__ = ["PACKAGE_DIR", "ZOO_DIR", "real_path", "library_roots", "is_users", "parsed",
           "source_lines", "function_at"]
