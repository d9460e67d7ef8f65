"""Buffer reuse: sequence-sized results written into buffers that died before them.

On CPU a fresh large tensor costs more to touch than most ops cost to compute: its pages are
mapped and zeroed by the kernel on first write (a 32 MB ``mul`` runs in about 3 ms into an
existing buffer and 20 ms into a fresh one on the machine ``docs/benchmarks.md`` describes). A
feature graph's forward and backward run dozens of such ops. ``reuse_buffers`` rewrites an
aten graph so that each large result is written, with the op's ``out=`` overload, into the
storage of a value no later node reads: into an operand that dies at a pointwise op (that op
then runs in place on exactly its own operand's elements), or into any dead buffer large enough
(read through ``as_strided`` in the result's own layout). The ops and their arguments are
unchanged; only where results live changes, so every value is bit-identical.

Only storages the graph owns are reused: results of its own ops, and the inputs the caller
names (a backward's saved activations, which nothing reads after it). Graph outputs, and
everything aliasing them, are never written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef
from torch._subclasses.fake_tensor import FakeTensorMode

#: Results smaller than this many bytes are left where the allocator puts them.
MIN_BYTES = 1 << 20

_NEVER = math.inf


def out_overload(op):
    """The ``out=`` overload of the functional aten overload ``op`` and its out argument's name,
    or None: same leading arguments, one keyword-only written tensor more."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    args = op._schema.arguments
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        cargs = candidate._schema.arguments
        written = [a for a in cargs if a.alias_info is not None and a.alias_info.is_write]
        if len(written) != 1 or not written[0].kwarg_only or len(cargs) != len(args) + 1:
            continue
        rest = [a for a in cargs if a is not written[0]]
        if [(a.name, str(a.type)) for a in rest] == [(a.name, str(a.type)) for a in args]:
            return candidate, written[0].name
    return None


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of storage a tensor of ``t``'s layout reaches from offset 0."""
    if t.numel() == 0:
        return 0
    reach = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return reach * t.element_size()


@dataclass
class _Buffer:
    """One storage of the graph: the node that reaches it first, and its last reader."""

    anchor: torch.fx.Node
    owned: bool
    nbytes: int
    dtype: torch.dtype
    device: torch.device
    last: float = -1
    nodes: list = field(default_factory=list)


def _fake_inputs(gm, example_inputs, mode):
    """Fake tensors of the inputs' layouts, each on its own storage (``None`` for non-tensors)."""
    fakes = []
    with mode:
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                span = max(1, _span_bytes(x) // x.element_size())
                base = torch.empty(span, dtype=x.dtype, device=x.device)
                fakes.append(base.as_strided(x.shape, x.stride(), x.storage_offset()))
            else:
                fakes.append(x)
    return fakes


def _buffers(gm, owned_inputs: dict[str, object]):
    """Every node's buffer (``None`` for non-tensors), with owners and last readers.

    ``owned_inputs`` maps placeholder names the graph may write to a group key: inputs of one
    group are views of one storage of the caller's."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_storage: dict = {}
    by_group: dict = {}
    node_buf: dict = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            node_buf[node] = None
            continue
        if node.op == "placeholder" and node.name in owned_inputs:
            group = owned_inputs[node.name]
            buf = by_group.get(group)
            if buf is None:
                buf = by_group[group] = _Buffer(node, True, 0, val.dtype, val.device)
            by_storage[StorageWeakRef(val.untyped_storage())] = buf
        else:
            key = StorageWeakRef(val.untyped_storage())
            buf = by_storage.get(key)
            if buf is None:
                buf = by_storage[key] = _Buffer(node, node.op == "call_function", 0,
                                                val.dtype, val.device)
        buf.nbytes = max(buf.nbytes, val.untyped_storage().nbytes(), _span_bytes(val))
        buf.nodes.append(node)
        node_buf[node] = buf
    for node in gm.graph.nodes:
        for user in node.users:
            buf = node_buf.get(node)
            if buf is not None:
                buf.last = max(buf.last, _NEVER if user.op == "output" else order[user])
    for buf in {id(b): b for b in node_buf.values() if b is not None}.values():
        if any(n.op == "output" for node in buf.nodes for n in node.users):
            buf.last = _NEVER
        if any(n.meta["val"].dtype != buf.dtype for n in buf.nodes):   # read as two dtypes
            buf.owned = False
    return node_buf, order


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.storage_offset() == b.storage_offset())


def _in_place_operand(node, val, node_buf, idx):
    """An operand of the pointwise ``node`` that dies at it, owned, laid out as its result."""
    if torch.Tag.pointwise not in node.target.tags:
        return None
    for arg in node.args:
        if not isinstance(arg, torch.fx.Node):
            continue
        buf = node_buf.get(arg)
        if buf is not None and buf.owned and buf.last == idx \
                and _same_layout(arg.meta["val"], val) \
                and all(node_buf.get(a) is not buf for a in node.args if a is not arg):
            return arg
    return None


def propagate(gm: torch.fx.GraphModule, example_inputs) -> None:
    """Every node's ``meta["val"]``: a fake tensor of its layout, every input on a storage of
    its own, so storages tell which values alias."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(
        *_fake_inputs(gm, example_inputs, mode))


def output_storages(gm: torch.fx.GraphModule, example_inputs, first: int) -> list:
    """For each output of ``gm`` from position ``first`` on, a key of the storage it lies in
    where ``gm`` allocates that storage itself and no output before ``first`` lies in it too;
    else None (it aliases an input, or a value the caller receives)."""
    propagate(gm, example_inputs)

    def storage(node):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None

    outputs = list(gm.graph.output_node().args[0])
    inputs = {storage(n) for n in gm.graph.nodes if n.op == "placeholder"}
    given = {storage(n) for n in outputs[:first]}
    keys = [storage(n) for n in outputs[first:]]
    return [None if k is None or k in inputs or k in given else k for k in keys]


def reuse_buffers(gm: torch.fx.GraphModule, example_inputs, *,
                  owned_inputs: dict[str, object] | None = None,
                  min_bytes: int = MIN_BYTES) -> torch.fx.GraphModule:
    """``gm`` rewritten in place so large results reuse dead buffers (see the module).

    ``owned_inputs`` maps the names of placeholders the graph may overwrite once they are dead
    to a key per storage (inputs with one key are views of one storage)."""
    propagate(gm, example_inputs)
    node_buf, order = _buffers(gm, owned_inputs or {})
    dead: list[_Buffer] = []
    graph = gm.graph
    for node in list(graph.nodes):
        idx = order[node]
        buf = node_buf.get(node)
        inputs = list(node.all_input_nodes)
        if node.op == "call_function" and buf is not None and buf.anchor is node and buf.owned \
                and buf.nbytes >= min_bytes:
            target = _reuse_target(node, buf, node_buf, dead, idx)
            if target is not None:
                _rewrite(graph, node, buf, target, node_buf, dead)
        for arg in inputs:                   # buffers whose last reader is this node die
            b = node_buf.get(arg)
            if b is not None and b.owned and b.last == idx and b not in dead:
                dead.append(b)
    graph.lint()
    gm.recompile()
    return gm


def writes_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (after ``reuse_buffers``) writes a result into one of its inputs' memory,
    through an ``out=`` argument that is a placeholder or a view of one."""
    for node in gm.graph.nodes:
        for name, dest in node.kwargs.items():
            while name.startswith("out") and isinstance(dest, torch.fx.Node):
                if dest.op == "placeholder":
                    return True
                dest = dest.args[0] if dest.op == "call_function" and dest.args else None
    return False


def _reuse_target(node, buf, node_buf, dead, idx):
    """``(operand node, None)`` to run in place, ``(dead buffer, None)`` to write into, or None."""
    found = out_overload(node.target)
    if found is None:
        return None
    val = node.meta["val"]
    operand = _in_place_operand(node, val, node_buf, idx)
    if operand is not None:
        return operand
    fits = [b for b in dead if b.dtype == val.dtype and b.device == val.device
            and b.nbytes >= _span_bytes(val) and b.last < idx]
    return min(fits, key=lambda b: b.nbytes) if fits else None


def _rewrite(graph, node, buf, target, node_buf, dead):
    """``node`` as its ``out=`` overload writing into ``target``; its buffer merges into it."""
    overload, out_name = out_overload(node.target)
    val = node.meta["val"]
    with graph.inserting_before(node):
        if isinstance(target, torch.fx.Node):
            out = target
            into = node_buf[target]
        else:
            into = target
            dead.remove(target)
            out = graph.call_function(torch.ops.aten.as_strided.default,
                                      (into.anchor, list(val.shape), list(val.stride()),
                                       val.storage_offset()))
        new = graph.call_function(overload, node.args, {**node.kwargs, out_name: out})
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    into.last = max(into.last, buf.last)
    into.nodes.extend(n if n is not node else new for n in buf.nodes)
    for n in buf.nodes:
        node_buf[n if n is not node else new] = into


__all__ = ["reuse_buffers", "writes_inputs", "output_storages", "out_overload", "propagate",
           "MIN_BYTES"]
