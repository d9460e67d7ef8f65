"""How far a speed target could go: a call's own matrix products, replayed alone.

A layer that misses a target while most of its time is matmuls cannot meet it by shedding
overhead, and a target above what the machine's GEMM peak allows cannot be met at all.
``record_matmuls`` runs one call under a ``TorchDispatchMode`` and records every matrix product
it dispatches (op, operand shapes, strides and dtypes, forward and backward alike); ``Replay``
runs exactly those products alone, on fresh operands of the same layouts, as a row timed side by
side with the call. Two ceilings follow for a target:

* *its matmuls alone*: the call's time if everything around its products were free — what
  fusing or removing all elementwise work, copies and dispatch could at most give this plan;
* *at the GEMM peak*: the layer's useful FLOPs done at the measured peak rate — what any
  implementation could at most give on this machine.

Products a custom kernel computes (the Triton ops on a GPU) are not aten matmuls and are not
recorded, so there the first ceiling only loosens; it stays an upper bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_aten = torch.ops.aten
#: The matrix products a call is charged for: everything that runs on the GEMM kernels.
MATMULS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.mv,
                     _aten.addmv, _aten.dot, _aten._addmm_activation})


@dataclass(frozen=True)
class Operand:
    """The layout of one tensor operand: enough to allocate a stand-in of the same shape."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Product:
    """One recorded matrix product: the op and its arguments, tensors replaced by ``Operand``."""

    op: Any
    args: tuple
    kwargs: dict


def _spec(value):
    if isinstance(value, torch.Tensor):
        return Operand(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.products: list[Product] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in MATMULS:
            self.products.append(Product(func, tree_map(_spec, args), tree_map(_spec, kwargs)))
        return func(*args, **kwargs)


def record_matmuls(call: Callable, *args) -> list[Product]:
    """The matrix products one ``call(*args)`` dispatches, in order (its backward's too, when
    the call runs one)."""
    with _Recorder() as recorder:
        call(*args)
    return recorder.products


def _filled(op: Operand) -> torch.Tensor:
    """A tensor of ``op``'s layout (broadcast strides too) over normally distributed storage."""
    extent = 1 + sum((n - 1) * st for n, st in zip(op.shape, op.stride)) if all(op.shape) else 0
    storage = torch.empty(extent, dtype=op.dtype, device=op.device)
    storage = storage.normal_() if storage.is_floating_point() else storage.zero_()
    return storage.as_strided(op.shape, op.stride)


def _stand_ins(products: list[Product]) -> list[tuple[tuple, dict]]:
    """Fresh operands for every product, one tensor per (layout, argument position): products
    that share a layout share the stand-in, while a product's own operands never alias."""
    cache: dict = {}

    def build(position):
        def make(value):
            if not isinstance(value, Operand):
                return value
            key = (value, position)
            if key not in cache:
                cache[key] = _filled(value)
            return cache[key]
        return make

    return [(tuple(tree_map(build(i), a) for i, a in enumerate(p.args)),
             {k: tree_map(build(k), v) for k, v in p.kwargs.items()}) for p in products]


class Replay:
    """``Replay(products)()`` runs the recorded products back to back on stand-in operands
    (allocated once), ignoring its arguments: a row to time next to the call it came from."""

    def __init__(self, products: list[Product]):
        self.products = products
        self.calls = list(zip((p.op for p in products), _stand_ins(products)))

    def __call__(self, *ignored) -> None:
        with torch.no_grad():
            for op, (args, kwargs) in self.calls:
                op(*args, **kwargs)


def matmul_flops(products: list[Product]) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of the recorded products."""
    total = 0
    for p in products:
        a, b = _operands(p)
        batch = a.shape[0] if len(a.shape) == 3 else 1
        m = a.shape[-2] if len(a.shape) >= 2 else 1
        n = b.shape[-1] if len(b.shape) >= 2 else 1
        total += 2 * batch * m * a.shape[-1] * n
    return total


def _operands(p: Product) -> tuple[Operand, Operand]:
    """The two factors of a product (the accumulator of ``addmm``-style ops skipped)."""
    tensors = [x for x in p.args if isinstance(x, Operand)]
    accumulates = p.op.overloadpacket in (_aten.addmm, _aten.baddbmm, _aten.addbmm,
                                          _aten.addmv, _aten._addmm_activation)
    return tuple(tensors[1:3] if accumulates else tensors[:2])


__all__ = ["MATMULS", "Operand", "Product", "Replay", "matmul_flops", "record_matmuls"]
