"""Forward-mode derivatives one at a time in the process.

``torch.func.jvp`` keeps its dual level process-wide, not per thread: two threads taking
forward-mode derivatives at once close each other's level ("no level exists"). The plans that
read an update's coefficients by ``jvp`` take them through this one, so a converted layer called
from several threads at once runs as it does from one.
"""
from __future__ import annotations

import threading

import torch.func

#: Re-entrant: a function differentiated may itself take a derivative.
_ONE_AT_A_TIME = threading.RLock()


def jvp(func, primals: tuple, tangents: tuple):
    """``torch.func.jvp(func, primals, tangents)``, holding the process's forward-mode lock."""
    with _ONE_AT_A_TIME:
        return torch.func.jvp(func, primals, tangents)


__all__ = ["jvp"]
