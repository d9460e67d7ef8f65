"""What the lossy passes share to fold what they remove: calibration values over the chunks that
update the state, and constants written into a body.

A fold is measured on the chunks whose update reaches the state (the last chunk of an
``apply_only`` loop is read, never trained on, so it does not count) and written into the body
either as a Python number in an op's arguments or as a tensor attribute of the body
(``get_attr``) whose shape does not depend on the batch size; a constant that must take the
shape of the value it replaces is expanded to it (the size arguments are fitted like every other
size of the body).
"""
from __future__ import annotations

import dataclasses

from typing import Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..analysis.dependence import node_shape
from ..errors import ConversionError
from ..ir import TTTProgram

aten = torch.ops.aten


def update_chunk_values(calibration, program: TTTProgram, nodes: Sequence[torch.fx.Node]
                        ) -> list[list[list[torch.Tensor]]]:
    """Per calibration sample, per node, the node's value in every full chunk that updates the
    state (``[sample][node][chunk]``)."""
    from ..lowering.chunking import chunk_streams

    out = []
    for sample in calibration.samples:
        one = dataclasses.replace(calibration, samples=[sample])
        values = one.chunk_values(program, nodes)
        _states, invariants = one.program_inputs(program, sample)
        _streams, layout = chunk_streams(program, invariants)
        n = len(values[0]) if values else 0
        if program.last_chunk == "apply_only" and not layout.partial:
            n -= 1                            # the last chunk is only read
        out.append([v[:max(n, 0)] for v in values])
    if nodes and not any(sample[0] for sample in out):
        raise ConversionError(
            f"no full calibration chunk of {program.module_path or 'the loop'} updates the state "
            f"(chunks of {program.chunk_size} tokens), so there is nothing to fold from; pass "
            "calibration inputs at least two chunks long.")
    return out


def fold_source(context, name: str) -> tuple[dict | None, str]:
    """How a pass gets its constants: ``(replayed constants or None, mode)`` with mode
    ``"replay"``, ``"measure"``, ``"unfolded"`` (``fold=False``) or ``"no_calibration"``."""
    if not context.fold:
        return None, "unfolded"
    replayed = context.replay(name)
    if replayed is not None:
        return replayed, "replay"
    if context.calibration is None:
        return None, "no_calibration"
    return None, "measure"


def resolve_folds(context, name: str, measure: Callable[[], dict]) -> tuple[dict | None, str]:
    """The constants of pass ``name`` and how they were had (``fold_source``'s mode): measured
    by ``measure()`` and recorded in ``context.folds`` when nothing is there to replay."""
    folded, mode = fold_source(context, name)
    if mode == "measure":
        folded = measure()
        context.folds[name] = folded
    return folded, mode


def folded_constant(folded: dict | None, key: str, name: str, default):
    """Entry ``key`` of pass ``name``'s constants, or ``default`` when nothing is folded."""
    if folded is None:
        return default
    if key not in folded:
        raise ConversionError(
            f"the folds replayed for {name} have no constant for {key} (they hold "
            f"{sorted(folded)}): they were recorded for another model or layer; convert with "
            "calibration data instead of these folds.")
    return folded[key]


def _fake_mode(node: torch.fx.Node):
    for n in [node, *node.all_input_nodes]:
        val = n.meta.get("val")
        mode = getattr(val, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def infer_meta(node: torch.fx.Node) -> None:
    """Give a node a pass inserted the ``meta["val"]`` (a fake tensor) analysis reads."""
    mode = _fake_mode(node)
    if mode is None:
        return
    args, kwargs = pytree.tree_map(
        lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
        (node.args, node.kwargs))
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _attr_name(gm: torch.fx.GraphModule, stem: str) -> str:
    i = 0
    while hasattr(gm, f"{stem}_{i}"):
        i += 1
    return f"{stem}_{i}"


def _after_placeholders(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")


def insert_tensor(program: TTTProgram, before: torch.fx.Node, value: torch.Tensor, stem: str
                  ) -> torch.fx.Node:
    """A ``get_attr`` node holding ``value`` (an attribute of the body), before ``before``."""
    gm = program.body
    name = _attr_name(gm, stem)
    gm.register_buffer(name, value, persistent=False)
    with gm.graph.inserting_before(_after_placeholders(gm.graph)):
        node = gm.graph.get_attr(name)
    mode = _fake_mode(before)
    node.meta["val"] = mode.from_tensor(value) if mode is not None else value
    return node


def replace_with_constant(program: TTTProgram, node: torch.fx.Node, value, stem: str) -> str:
    """Make every reader of ``node`` read the constant ``value`` (a float, or a tensor that
    broadcasts to ``node``'s shape) instead; returns how it was written.

    A float read only by elementwise products goes into their arguments; otherwise the constant
    becomes a body attribute, expanded to ``node``'s shape and copied (so views of it keep
    working) — every value downstream keeps its shape.
    """
    val = node.meta.get("val")
    dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
    device = val.device if isinstance(val, torch.Tensor) else "cpu"
    users = list(node.users)
    if isinstance(value, float) and users and all(
            u.op == "call_function" and u.target is aten.mul.Tensor
            and list(u.args[:2]).count(node) == 1 and isinstance(u.args[0], torch.fx.Node)
            and isinstance(u.args[1], torch.fx.Node) for u in users):
        for u in users:
            other = u.args[1] if u.args[0] is node else u.args[0]
            u.args = (other, value)
        program.recompile()
        return f"the number {value:.6g}"
    shape = node_shape(node)
    tensor = torch.as_tensor(value, dtype=torch.float64)
    tensor = tensor.reshape([1] * (len(shape) - tensor.dim()) + list(tensor.shape)) \
        if tensor.dim() < len(shape) else tensor
    tensor = tensor.to(dtype=dtype, device=device)
    const = insert_tensor(program, node, tensor, stem)
    graph = program.body.graph
    with graph.inserting_before((node if node.op != "placeholder" else const).next):
        expanded = graph.call_function(aten.expand.default, (const, list(shape)))
        copied = graph.call_function(aten.clone.default, (expanded,),
                                     {"memory_format": torch.contiguous_format})
    infer_meta(expanded)
    infer_meta(copied)
    node.replace_all_uses_with(copied, delete_user_cb=lambda u: u not in (expanded, copied))
    program.recompile()
    what = "a constant" if tensor.numel() == 1 else f"a constant of shape {tuple(tensor.shape)}"
    return f"{what} (body attribute {const.target})"


def scaled(program: TTTProgram, node: torch.fx.Node, factor: float, after: torch.fx.Node
           ) -> torch.fx.Node:
    """``node · factor`` inserted after ``after`` (``node`` itself when the factor is 1)."""
    if factor == 1.0:
        return node
    graph = program.body.graph
    at = after.next if after.op != "placeholder" else _after_placeholders(graph)
    with graph.inserting_before(at):
        out = graph.call_function(aten.mul.Tensor, (node, float(factor)))
    infer_meta(out)
    return out


__all__ = ["update_chunk_values", "fold_source", "resolve_folds", "folded_constant", "infer_meta",
           "insert_tensor", "replace_with_constant", "scaled"]
