"""Numbers a trace folds from the input's shape into its ops' float arguments and tensor constants.

The recognizer traces a layer at several shapes and fits its *integer* size arguments as
functions of the batch size and the length (``shapes.fit_template``). A float the code derives
from a size — a step ``1 / B``, ``1 / T`` or ``1 / sqrt(T)``, one over the number of chunks, the
divisor of a mean loss's gradient over the batch (``F.mse_loss`` under ``torch.func.grad``) — or a
tensor made of a size (``torch.tensor(T)``, ``torch.as_tensor(T)``, integers too) is held by the
trace as a plain constant, which no fit sees: the converted layer would run every
shape with the number of the shape it was traced at. Here the traces are compared float by float;
a number that moves with the length (or the number of chunks) is refused, naming the line, and
one that moves with the batch size only restricts the traced batch size to the example's, where
the number is the code's own (other batch sizes run as written or are refused).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..errors import UnsupportedTTTError
from ..ir import SRC


class BatchConstant(UnsupportedTTTError):
    """A number of the traced code moves with the batch size: the shape probe traces at the
    example's batch size alone, where the number is the code's own."""


@dataclass(frozen=True)
class ShapeConstant:
    """A float argument of ``node`` (in the reference trace) that differs in the traces at other
    shapes: ``moves`` names the sizes it moves with, ``values`` its value per trace."""

    node: torch.fx.Node
    moves: tuple[str, ...]
    values: dict[str, object]

    @property
    def with_length(self) -> bool:
        return any(m != "batch size" for m in self.moves)

    def describe(self) -> str:
        """What was found and where, in words."""
        src = self.node.meta.get(SRC)
        where = f" at {src.at()}" if src is not None else ""
        seen = ", ".join(f"{_shown(v)} at {k}" for k, v in self.values.items())
        return (f"a number that depends on the {' and the '.join(self.moves)}{where}: "
                f"{seen}")


def _shown(value) -> str:
    """A float, or a tensor constant's values (a list), as a message shows it."""
    if isinstance(value, list):
        return f"{value[0]:.6g}" if len(value) == 1 else \
            f"a tensor constant [{', '.join(f'{v:.4g}' for v in value[:4])}{', …' if len(value) > 4 else ''}]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _floats(args, path=()):
    """``(path, value)`` of every float inside nested ``args`` (ints and bools excluded)."""
    if isinstance(args, float):
        yield path, args
    elif isinstance(args, (list, tuple)):
        for i, a in enumerate(args):
            yield from _floats(a, path + (i,))
    elif isinstance(args, dict):
        for k, a in args.items():
            yield from _floats(a, path + (k,))


def _values(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict:
    """The numbers ``node`` carries: its float arguments by path, or the tensor constant it
    reads (a ``torch.tensor(1 / B)`` or ``torch.tensor(T)`` is baked into the trace as one, of any
    real dtype), as a list."""
    if node.op == "get_attr":
        t = getattr(gm, node.target, None)
        return {(): t.detach().flatten().tolist()} if isinstance(t, torch.Tensor) and \
            t.numel() <= 64 and not t.is_complex() else {}
    return dict(_floats((node.args, node.kwargs)))


def _differing(ref: torch.fx.GraphModule, others: dict[str, torch.fx.GraphModule]):
    """``(node, {name: (value, other value)})`` for each number of ``ref`` another graph of the
    same ops holds with another value; graphs of other ops are skipped (the fit refuses them)."""
    ref_nodes = list(ref.graph.nodes)
    lists = {k: list(g.graph.nodes) for k, g in others.items()}
    lists = {k: ns for k, ns in lists.items() if len(ns) == len(ref_nodes) and all(
        (a.op, a.target) == (b.op, b.target) for a, b in zip(ref_nodes, ns))}
    for i, node in enumerate(ref_nodes):
        mine = _values(ref, node)
        if not mine:
            continue
        moved = {}
        for name, ns in lists.items():
            theirs = _values(others[name], ns[i])
            changed = [(v, theirs.get(p)) for p, v in mine.items() if theirs.get(p) != v]
            if changed:
                moved[name] = changed[0]
        if moved:
            yield node, moved


def shape_constant(ref, others: dict, labels: dict[str, str]) -> ShapeConstant | None:
    """The first float of the graph ``ref`` that moves with a size in ``others`` (the same graph
    traced at other shapes, by the size that moved: "batch size", "length", "number of chunks"),
    or ``None``; ``labels`` names each trace's shape for the message."""
    for node, moved in _differing(ref, others):
        values = {labels["ref"]: next(iter(moved.values()))[0]}
        values.update({labels[k]: v[1] for k, v in moved.items()})
        return ShapeConstant(node, tuple(moved), values)
    return None


def refuse_shape_constants(rolled, others: dict, labels: dict[str, str], where: str) -> None:
    """Raise when the loop's body or the code around it (``rolled``, a ``RolledLoop``) holds a
    float that moves with a size in ``others`` (the same loop rolled at other shapes): an
    ``UnsupportedTTTError`` for the length, a ``BatchConstant`` for the batch size alone."""
    others = {k: r for k, r in others.items() if r is not None and r is not rolled}
    for part, graph in (("loop body", lambda r: r.program.body), ("code around the loop",
                                                                  lambda r: r.outer)):
        found = shape_constant(graph(rolled), {k: graph(r) for k, r in others.items()}, labels)
        if found is None:
            continue
        if found.with_length:
            raise UnsupportedTTTError(
                f"{where}: the {part} computes with {found.describe()}. A trace holds such a "
                "number as a constant, so the converted layer would use the traced one at every "
                "length. Compute it as a tensor from the input before the loop (for example "
                "`x.new_full((), T).rsqrt()` or `x.new_ones(()) / T` rather than "
                "`1 / math.sqrt(T)` or `torch.tensor(1 / T)`, which a trace bakes in), which the "
                "converted layer computes at each call, or make it "
                "a constant of the layer.")
        raise BatchConstant(
            f"the {part} of {where} computes with {found.describe()} (a mean over the batch "
            "divides by it, say)")


__all__ = ["ShapeConstant", "shape_constant", "BatchConstant", "refuse_shape_constants"]
