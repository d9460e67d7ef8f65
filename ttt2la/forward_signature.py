"""A converted class's ``forward`` under the signature of the user's: the converted forward takes
``(*args, ttt_state=None, return_ttt_state=False, **kwargs)``, so what reads a module's signature
to bind its inputs by name — ``torch.export``'s ``dynamic_shapes`` keyed by argument name,
``inspect.signature(model.forward)`` — saw ``args`` where the layer takes ``x``. Each class gets
its own function object over the one code object (TorchDynamo guards a function by its code, so
compiled graphs are unchanged) with the user's parameters and the two streaming keywords."""
from __future__ import annotations

import inspect
import types
from typing import Callable

STREAMING = ("ttt_state", "return_ttt_state")


def forward_like(cls: type, converted: Callable) -> Callable:
    """``converted`` as a function of its own whose ``__signature__`` is ``cls.forward``'s, the
    streaming keywords added; ``converted`` itself where that signature cannot hold them."""
    try:
        own = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return converted
    params = list(own.parameters.values())
    if any(p.name in STREAMING for p in params):
        return converted
    kinds = [p.kind for p in params]
    where = kinds.index(inspect.Parameter.VAR_KEYWORD) if inspect.Parameter.VAR_KEYWORD in kinds \
        else len(params)
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
             for name, default in zip(STREAMING, (None, False))]
    try:
        signature = own.replace(parameters=params[:where] + extra + params[where:])
    except ValueError:
        return converted
    fn = types.FunctionType(converted.__code__, converted.__globals__, converted.__name__,
                            converted.__defaults__, converted.__closure__)
    fn.__kwdefaults__ = dict(converted.__kwdefaults__ or {})
    fn.__doc__, fn.__qualname__ = converted.__doc__, f"{cls.__name__}.forward"
    fn.__module__ = converted.__module__
    fn.__signature__ = signature
    return fn


__all__ = ["forward_like"]
