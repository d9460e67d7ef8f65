"""A layer's traces, kept like compiles: the same code and configuration at the same shapes is
traced once.

``make_fx`` traces with fake tensors, so a trace depends on the layer's code, its configuration
and the shapes, dtypes and devices of what it is given, never on values (a value read out of a
tensor is refused as data-dependent). Recognition probes a layer at shapes that follow from its
chunk size, not from the example, so the same layer recognized again from another example traces
the same shapes: those traces are copied instead of traced again. Traces are keyed by what the
recognition cache keys a layer by (``recognize._layer_key``: its code, configuration and the
values its code reads from outside it), plus the shapes traced, whether each weight requires
grad, grad mode, autocast and the default dtype.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from ..ir import copy_graph, graph_module
from .capture import trace

_TRACES: "OrderedDict[tuple, torch.fx.GraphModule]" = OrderedDict()
_SIZE = 32


@dataclass(frozen=True)
class LayerTraces:
    """``fn(params_and_buffers, *flat_inputs)``, a layer's forward called functionally, with the
    key of the layer's code and configuration (``None``: a layer the key cannot describe, traced
    every time)."""

    fn: Callable[..., Any]
    layer_key: tuple | None

    def __call__(self, *args):
        return self.fn(*args)

    def trace(self, weights: dict[str, torch.Tensor], *inputs) -> torch.fx.GraphModule:
        """``capture.trace(fn, weights, *inputs)``, from the cache when these shapes were traced
        before. Every call gets a graph of its own, as recognition rewrites the graphs it rolls."""
        key = self._key(weights, inputs)
        kept = _TRACES.get(key) if key is not None else None
        if kept is None:
            kept = trace(self.fn, weights, *inputs)
            if key is None:
                return kept
            _TRACES[key] = kept
            while len(_TRACES) > _SIZE:
                _TRACES.popitem(last=False)
        else:
            _TRACES.move_to_end(key)
        return graph_module(kept, copy_graph(kept.graph))

    def _key(self, weights: dict, inputs: tuple) -> tuple | None:
        if self.layer_key is None:
            return None
        return (self.layer_key,         # hashable, as the descriptions are
                tuple((name, _described(w)) for name, w in weights.items()),
                tuple(_described(x) for x in inputs),
                torch.is_grad_enabled(), torch.get_default_dtype(),
                tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                      for d in ("cpu", "cuda")))


def clear_caches() -> None:
    """Forget every kept recognition and trace (up to 32 of each, with the graphs they hold), as
    after a fresh start: for a process that converts many different layers and wants the memory
    back, and for tests that must not depend on what was converted before them."""
    from .recognize import _CACHE
    from .summed_products import _traced

    _TRACES.clear()
    _CACHE.clear()
    _traced.cache_clear()


def _described(x) -> tuple:
    """What a trace sees of one argument: a tensor's metadata, any other value itself."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, str(x.device), x.requires_grad)
    return ("value", type(x), repr(x))


__all__ = ["LayerTraces", "clear_caches"]
