"""Feature graphs specialised to the tensors they run on.

A lifted layer's token-local graphs (φ(Q), φ(K), the effective value, the output's
post-processing) are traced once, functional, in the layout of one traced chunk. Run over whole
sequences on CPU, two things cost more than the arithmetic:

* a small weight times a token-major stream read transposed, ``W @ Xᵀ``, runs slower than the
  same product oriented token-major, ``(X @ Wᵀ)ᵀ``, and leaves the features transposed for the
  op that reads them;
* every elementwise op writes a fresh sequence-sized tensor, and touching a fresh tensor's pages
  costs more than the op (``silu`` over 32 MB here: 30 ms into a fresh tensor, 9 ms into an
  existing one).

``SpecializedGraph`` rewrites a copy of the graph for each input signature (shapes, strides,
dtypes, whether autograd records, the caller's autocast on the inputs' devices): matmuls oriented
token-major where the stream lies so, and, when nothing is recorded for a gradient, elementwise ops
writing into an intermediate that dies with them (torch.fx's re-inplacing pass, which never writes
into a graph input or into a buffer a live value aliases); when a gradient is recorded, one
autograd function whose forward and backward graphs write large results into dead buffers
(``planned_autograd``). The values computed are the same ops' values; only the orientation of the
products and where intermediates live change.

The graphs are traced without autocast and run under the caller's: an op autocast casts (a
weighted φ's ``bmm``) is cast when the graph runs, as in the code as written. Its copy is
planned under the caller's autocast too, on fake tensors of the dtypes the call computes in.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.reinplace import reinplace

from ttt2la.ir import graph_module
from ttt2la.lowering.planned_autograd import planned_autograd
from ttt2la.preparation import autocast_state, out_of_sight

aten = torch.ops.aten

#: Specialised graphs kept per feature graph, most recently used first out last.
CACHE_SIZE = 8
#: A graph recorded for a gradient is planned (``planned_autograd``) only where its largest input
#: is at least this large, and from the second call at a shape: planning takes 130–380 ms, and
#: on this project's CPU the planned step ran at 0.85–0.95× the graph's own autograd at 256 KiB
#: streams, 1.0× at 1 MiB, 1.10× at 4 MiB and 1.32× at 32 MiB (LaCT variant 2, one thread).
PLANNED_FROM_BYTES = 2 << 20

_PRODUCTS = (aten.bmm.default, aten.mm.default)


def _signature(args, records: bool) -> tuple:
    """What a specialised copy depends on. Without a gradient, a tensor's sizes are not part of
    it: the products' orientation reads which axis has unit stride, and re-inplacing reads
    aliasing and broadcasting, which only size-1 axes change; so a copy serves every length and
    batch of one layout, and a call at a new length does not pay for planning it again. The
    buffers a recorded graph reuses are chosen by size, so with a gradient the sizes count."""
    return (records, autocast_state(args)) + tuple(
        (_exact(a) if records else _layout(a)) if isinstance(a, torch.Tensor) else a
        for a in args)


def _exact(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _layout(t: torch.Tensor) -> tuple:
    """``t``'s layout without its sizes: per axis whether it has one element, a zero stride (an
    expanded axis) or a unit one, the axes from the largest stride to the smallest."""
    axes = tuple((n == 1, s == 0, s == 1) for n, s in zip(t.shape, t.stride()))
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return axes, order, t.dtype, t.device


def _symbolic(args) -> bool:
    return any(isinstance(n, torch.SymInt) for a in args if isinstance(a, torch.Tensor)
               for n in (*a.shape, *a.stride()))


def _records_grad(args) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _copy(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A copy of ``gm`` whose tensor constants (``get_attr``) are trailing inputs, and their
    values: the passes below run on fake tensors, and never write into an input."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    last = [n for n in graph.nodes if n.op == "placeholder"][-1:]
    constants = []
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        value = torch.fx.graph_module._get_attr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        anchor = last[0].next if last else next(iter(graph.nodes))
        with graph.inserting_before(anchor):
            placeholder = graph.placeholder(f"constant_{len(constants)}")
        last = [placeholder]
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        constants.append(value)
    return graph_module(gm, graph), constants


def _reads_transposed(node) -> bool:
    """The tensor ``node`` is a transposed row-major matrix (unit stride along its rows)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] > 1
            and val.stride(-2) == 1 and val.stride(-1) != 1)


def token_major_products(gm: torch.fx.GraphModule, args) -> torch.fx.GraphModule:
    """``gm`` with each product ``A @ B`` whose ``B`` is read transposed computed as
    ``(Bᵀ @ Aᵀ)ᵀ``: the long operand row-major, the result a transposed view of a row-major
    tensor, which elementwise consumers keep and the runtime op reads as it lies."""
    FakeTensorProp(gm).propagate(*args)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _PRODUCTS:
            continue
        a, b = node.args
        if not _reads_transposed(b) or _reads_transposed(a):
            continue
        with graph.inserting_before(node):
            bt = graph.call_function(aten.transpose.int, (b, -2, -1))
            at = graph.call_function(aten.transpose.int, (a, -2, -1))
            product = graph.call_function(node.target, (bt, at))
            flipped = graph.call_function(aten.transpose.int, (product, -2, -1))
        node.replace_all_uses_with(flipped)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


class SpecializedGraph:
    """Calls a copy of ``graph`` specialised to the call's input signature (see the module)."""

    def __init__(self, graph: torch.fx.GraphModule):
        self.graph = graph
        self._cache: OrderedDict[tuple, tuple[torch.fx.GraphModule, list]] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()    # recorded shapes called once

    def __call__(self, *args):
        if _symbolic(args) or torch.compiler.is_compiling():
            return self.graph(*args)    # a compiler traces the call: it fuses and plans itself
        records = _records_grad(args)
        if records and not self._planned(args):
            return self.graph(*args)    # autograd through the graph as traced
        gm, constants = self.for_inputs(args, records)
        return gm(*args, *constants)

    def specialised_call(self, *args):
        """The call on the copy specialised to ``args``, whatever their size."""
        gm, constants = self.for_inputs(args)
        return gm(*args, *constants)

    def _planned(self, args) -> bool:
        """Whether a call recording a gradient runs a planned copy (``PLANNED_FROM_BYTES``): at a
        shape called before, or one planned already, or under saved-tensor hooks (activation
        checkpointing recomputes the call in the backward, and must save what its forward did)."""
        if max((a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)),
               default=0) < PLANNED_FROM_BYTES:
            return False
        key = _signature(args, True)
        if key in self._cache or key in self._seen \
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return True
        self._seen[key] = None
        if len(self._seen) > CACHE_SIZE:
            self._seen.popitem(last=False)
        return False

    def for_inputs(self, args, records: bool | None = None
                   ) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
        """The specialised graph for ``args`` and the constants it takes after them
        (``records``: whether the call records a gradient, when the caller knows)."""
        if records is None:
            records = _records_grad(args)
        key = _signature(args, records)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._specialise(args, records)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return found

    def _specialise(self, args, records: bool):
        # built on fake tensors, out of sight of the call (``preparation``) but under its
        # autocast: its casts set the dtypes the products and the in-place writes are planned for
        with out_of_sight(autocast=autocast_state(args)):
            gm, constants = _copy(self.graph)
            every = (*args, *constants)
            gm = token_major_products(gm, every)
            if records:
                return planned_autograd(gm), constants
            return reinplace(gm, *every), constants


__all__ = ["SpecializedGraph", "token_major_products", "CACHE_SIZE", "PLANNED_FROM_BYTES"]
