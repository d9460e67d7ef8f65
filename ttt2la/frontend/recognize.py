"""Recognize the TTT inner loop of one layer: trace it small, roll the loop up, generalize shapes.

``recognize_layer`` traces the layer with ``make_fx`` at three small shapes chosen from the
chunk size (``L0 = 3C + r`` shows three loop iterations, enough to tell carried state from
chunk streams), rolls the loop up at each, and fits the size arguments of the outer graph and
of the body as functions of batch size and length (``shapes.fit_template``).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.func import functional_call

from ..errors import UnsupportedTTTError
from ..ir import TTTProgram
from .capture import trace
from .discover import LoopCandidate
from .loops import find_loops
from .rollup import RolledLoop, roll_up
from .shapes import GraphTemplate, fit_template

B0, B1 = 2, 3


@dataclass
class InputLayout:
    """Which layer inputs carry the batch and the sequence, so any (B, L) can be read off."""

    batch_axis: dict[int, int]          # flat input index -> batch axis
    token_axis: dict[int, int]          # flat input index -> token axis
    ref: int                            # flat input index to read B and L from

    def sizes(self, flat_inputs: list) -> tuple[int, int]:
        x = flat_inputs[self.ref]
        return x.shape[self.batch_axis[self.ref]], x.shape[self.token_axis[self.ref]]


@dataclass
class RecognizedLayer:
    """What ``recognize_layer`` learned about one layer."""

    path: str
    candidate: LoopCandidate
    rolled: RolledLoop                  # at (B0, L0)
    rolled_L: RolledLoop                # at (B0, L1)
    rolled_B: RolledLoop                # at (B1, L0)
    layout: InputLayout
    in_spec: Any
    outer: GraphTemplate
    L0: int
    L1: int

    @property
    def program(self) -> TTTProgram:
        return self.rolled.program


def _resize(x: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    reps = -(-n // x.shape[axis])
    if reps > 1:
        x = torch.cat([x] * reps, dim=axis)
    return x.narrow(axis, 0, n).contiguous()


def _layout(flat: list, seq_len: int | None, batch: int) -> InputLayout:
    batch_axis, token_axis = {}, {}
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            continue
        if x.shape[0] == batch:
            batch_axis[i] = 0
        if seq_len is not None:
            for ax in range(1, x.dim()):
                if x.shape[ax] == seq_len:
                    token_axis[i] = ax
                    break
    refs = [i for i in token_axis if i in batch_axis]
    if not refs:
        raise UnsupportedTTTError(
            "could not tell which axis of the layer's input is the sequence: no input has an "
            f"axis of length {seq_len} after a batch axis of size {batch}. Pass example inputs "
            "whose sequence length differs from every feature size.")
    return InputLayout(batch_axis, token_axis, refs[0])


def _inputs_at(flat: list, layout: InputLayout, B: int, L: int) -> list:
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            if i in layout.batch_axis:
                x = _resize(x, layout.batch_axis[i], B)
            if i in layout.token_axis:
                x = _resize(x, layout.token_axis[i], L)
        out.append(x)
    return out


def layer_function(module: torch.nn.Module, in_spec) -> Callable:
    """``f(params_and_buffers, *flat_inputs)`` calling the module functionally."""
    def f(pb, *flat):
        args, kwargs = pytree.tree_unflatten(list(flat), in_spec)
        return functional_call(module, pb, args, kwargs)
    return f


def params_and_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _roll_at(cand: LoopCandidate, fn, flat: list, layout, B, L) -> RolledLoop:
    inputs = _inputs_at(flat, layout, B, L)
    pb = {k: v.detach() for k, v in params_and_buffers(cand.module).items()}
    gm = trace(fn, pb, *inputs)
    loops = [ld for ld in find_loops(gm) if ld[0] == cand.loop]
    if not loops:
        raise UnsupportedTTTError(
            f"the loop at {cand.loop.src} did not run when {cand.path or 'the model'} was traced "
            f"at batch {B}, length {L}")
    return roll_up(gm, *loops[0], module_path=cand.path)


_CACHE: "OrderedDict[tuple, RecognizedLayer]" = OrderedDict()
_CACHE_SIZE = 32


def _signature(cand: LoopCandidate, flat: list, seq_len) -> tuple | None:
    """What determines the traces of a layer: its code, configuration and tensor shapes.

    Parameters and buffers are graph inputs, so their values do not matter; plain Python
    attributes (chunk size, switches) steer the code and are part of the key. A layer holding
    a tensor that is neither a parameter nor a buffer is not cached (its value is baked in).
    """
    attrs = []
    for name, m in cand.module.named_modules():
        for k, v in sorted(vars(m).items()):
            if isinstance(v, torch.Tensor):
                return None
            if isinstance(v, (bool, int, float, str, type(None))) or callable(v) \
                    and not isinstance(v, torch.nn.Module):
                attrs.append((name, k, v))       # a function attribute steers the code too
        attrs.append((name, type(m)))
    tensors = tuple((n, tuple(t.shape), t.dtype, str(t.device))
                    for n, t in params_and_buffers(cand.module).items())
    inputs = tuple((tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor)
                   else ("value", repr(x)) for x in flat)
    return (type(cand.module), tuple(attrs), tensors, inputs, seq_len, cand.loop)


def recognize_layer(cand: LoopCandidate, seq_len: int | None) -> RecognizedLayer:
    """Trace ``cand.module`` at three small shapes and return its program and outer template.

    Layers with the same code, configuration and shapes (the blocks of one model, the same
    layer converted at several levels) are traced once: the result is cached like a compile.
    """
    flat, _ = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    key = _signature(cand, flat, seq_len)
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None:
        _CACHE.move_to_end(key)
        return dataclasses.replace(hit, path=cand.path, candidate=cand)
    result = _recognize_layer(cand, seq_len)
    if key is not None:
        _CACHE[key] = result
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return result


def _recognize_layer(cand: LoopCandidate, seq_len: int | None) -> RecognizedLayer:
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise UnsupportedTTTError(f"{cand.path} takes no tensor input")
    batch = tensors[0].shape[0]
    lengths = set(cand.slice_lengths)
    if seq_len is None or not any(seq_len in x.shape[1:] for x in tensors):
        seq_len = next((n for n in sorted(lengths, reverse=True)
                        if any(n in x.shape[1:] for x in tensors)), None)
    layout = _layout(flat, seq_len, batch)
    sizes = {c for c in cand.chunk_sizes if c > 0}
    C = max(sizes) if sizes else 1
    r = C // 2 if C > 1 else 1
    L0 = 3 * C + r
    L1 = L0 + 1
    fn = layer_function(cand.module, in_spec)
    rolled = _roll_at(cand, fn, flat, layout, B0, L0)
    if rolled.program.chunk_size != C:
        # the slices seen eagerly were not the chunk slices: retrace at the recognized size
        C = rolled.program.chunk_size
        r = C // 2 if C > 1 else 1
        L0, L1 = 3 * C + r, 3 * C + r + 1
        rolled = _roll_at(cand, fn, flat, layout, B0, L0)
    rolled_L = _roll_at(cand, fn, flat, layout, B0, L1)
    rolled_B = _roll_at(cand, fn, flat, layout, B1, L0)
    outer = fit_template(rolled.outer, rolled_L.outer, rolled_B.outer,
                         B0=B0, L0=L0, L1=L1, B1=B1, what=f"code around the loop of {cand.path}")
    return RecognizedLayer(cand.path, cand, rolled, rolled_L, rolled_B, layout, in_spec, outer,
                           L0, L1)


__all__ = ["recognize_layer", "RecognizedLayer", "InputLayout", "layer_function",
           "params_and_buffers", "B0", "B1"]
