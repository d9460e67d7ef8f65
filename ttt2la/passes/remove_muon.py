"""Step 6 of the paper: no Newton–Schulz (Muon) on the updates, no normalisation of the increment.

For every state updated as ``W' = W + Δ``, the transforms of its increment are found on the way
back from ``Δ`` through views, negations and products: Newton–Schulz iterations
(``match_newton_schulz``, LaCT's Muon) and normalisations of a value that does not read ``W``
(``match_norm``, ViTTT's ``g/(‖g‖+1)``). Each becomes ``s·X`` of its input ``X``. When the
iteration is wrapped in casts and transposes that undo each other (``G.to(bf16)``, ``Xᵀ`` for a
tall matrix, and back), the whole wrapped transform is replaced, so the increment keeps ``G``'s
dtype and layout.

The fold ``s`` is the scale the transform imposes on the increments, by least squares: the one
number that best reproduces the transformed increments from the raw ones on calibration data,
``s = Σ⟨T(X), X⟩ / Σ‖X‖²_F`` over every calibration chunk that updates the state (so ``s·X`` is
never further from ``T(X)`` than ``X`` itself is). Unfolded (``fold=False``) ``s = 1``. Not
exact: ``NS(A + B) ≠ NS(A) + NS(B)``, and after it a LaCT-style layer is standard linear
attention ``o = q(W₀ + Σ kᵀv)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..analysis.dependence import node_shape, op_name
from ..analysis.op_vocabulary import COPIES, EXPANDS, RESHAPES, SCALINGS, TRANSPOSES
from ..analysis.roles import VIEW_OPS, peel_views
from ..analysis.rules import match_newton_schulz, match_norm
from ..ir import TTTProgram, ancestors, op_at
from .base import Pass, PassContext, PassResult, register
from .folding import folded_constant, resolve_folds, scaled, update_chunk_values

aten = torch.ops.aten
_WALK = SCALINGS | VIEW_OPS


@dataclass
class IncrementTransform:
    """A transform of state ``state``'s increment: ``output = T(input)``, replaced by
    ``s·source`` at ``output`` (``output``/``source`` may be the wrapped form around it)."""

    state: int
    kind: str                       # "5-step Newton–Schulz iteration", "l2 normalisation" ...
    output: torch.fx.Node
    source: torch.fx.Node
    core: torch.fx.Node             # where the transform was matched (for reports)


def _increment(program: TTTProgram, i: int):
    """``Δ`` of ``W' = W + Δ`` or ``W' = W − Δ`` (its sign stays in the update), or ``None``."""
    w_in, w_out = program.state_inputs()[i], program.state_outputs()[i]
    if not isinstance(w_out, torch.fx.Node) or op_name(w_out) not in ("add", "sub") \
            or w_out.kwargs.get("alpha", 1) != 1:
        return None
    a, b = w_out.args[0], w_out.args[1]
    pairs = ((a, b), (b, a)) if op_name(w_out) == "add" else ((a, b),)
    for mine, delta in pairs:
        if peel_views(mine) is w_in and isinstance(delta, torch.fx.Node):
            return delta
    return None


def _swaps_last_two(node: torch.fx.Node) -> bool:
    if len(node.args) == 1:         # t, t_copy, mT
        return True
    dims = node.args[1:3]
    rank = len(node_shape(node) or ())
    return len(dims) == 2 and rank >= 2 and sorted(d % rank for d in dims) == [rank - 2, rank - 1]


def _chain(top: torch.fx.Node, bottom: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The ops from ``bottom`` up to ``top`` when ``top`` is ``bottom`` through view ops only."""
    ops, node = [], top
    while node is not bottom:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
                or op_name(node) not in VIEW_OPS:
            return None
        ops.append(node)
        node = node.args[0]
    return ops


def _neutral(ops: list[torch.fx.Node]) -> bool:
    """The views are casts, copies, same-shape reshapes and an even number of swaps of the
    last two axes."""
    swaps = 0
    for op in ops:
        name = op_name(op)
        if name in TRANSPOSES:
            if not _swaps_last_two(op):
                return False
            swaps += 1
        elif name in RESHAPES | EXPANDS:
            if node_shape(op) != node_shape(op.args[0]):
                return False
        elif name not in COPIES:
            return False
    return swaps % 2 == 0


def _widen(core: torch.fx.Node, x: torch.fx.Node):
    """``(output, source)``: the transform including the casts and transposes around it when
    those undo each other, else ``(core, x)``."""
    top = core
    while len(top.users) == 1:
        (user,) = top.users
        if user.op != "call_function" or op_name(user) not in VIEW_OPS:
            break
        top = user
    source = peel_views(x)
    out_ops, in_ops = _chain(top, core), _chain(x, source)
    if source is not x and out_ops is not None and in_ops is not None \
            and node_shape(top) == node_shape(source) and _neutral(out_ops + in_ops) \
            and _same_result_dtype(top, source):
        return top, source
    return core, x


def _dtype(node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _same_result_dtype(top: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Reading ``source`` instead of ``top`` changes no dtype downstream: same dtype, or every
    reader already computes in ``source``'s dtype (``W + NS(G)`` in bf16 promotes to W's)."""
    if _dtype(top) == _dtype(source):
        return True
    return all(op_name(u) in ("add", "sub", "mul") and _dtype(u) == _dtype(source)
               for u in top.users)


def increment_transforms(program: TTTProgram) -> list[IncrementTransform]:
    """Every Newton–Schulz iteration or normalisation applied to a state's increment."""
    ins = program.state_inputs()
    found = []
    for i in range(len(program.states)):
        delta = _increment(program, i)
        if delta is None:
            continue
        shape, stack, seen = node_shape(delta), [delta], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, torch.fx.Node) or node in seen or node.op != "call_function":
                continue
            seen.add(node)
            ns = match_newton_schulz(node)
            if ns is not None and node_shape(node) == shape:
                core = peel_views(node)
                out, src = _widen(core, ns.input)
                found.append(IncrementTransform(i, f"{ns.steps}-step Newton–Schulz iteration",
                                                out, src, core))
                continue
            norm = None if _scales_a_norm(node) else match_norm(node)
            if norm is not None and node_shape(node) == shape \
                    and ins[i] not in ancestors(norm.input):
                found.append(IncrementTransform(i, f"{norm.kind} normalisation", norm.output,
                                                norm.input, norm.output))
                continue
            name = op_name(node)
            if name == "div":
                stack.append(node.args[0])
            elif name in _WALK:
                stack.extend(node.all_input_nodes)
    return found


def _scales_a_norm(node: torch.fx.Node) -> bool:
    """Whether ``node`` multiplies a normalisation by a factor (``η · g/(‖g‖+1)``, a learned
    step size): the walk goes on to the normalisation, so that the factor stays — folded into
    the scale it would be a learned parameter frozen."""
    return op_name(node) == "mul" and any(
        isinstance(a, torch.fx.Node) and match_norm(peel_views(a)) is not None
        for a in node.args[:2])


def _projections(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> tuple[float, float]:
    """``(Σ⟨T(X), X⟩, Σ‖X‖²)`` over the chunks' increments ``X`` and their transforms ``T(X)``."""
    inner = square = 0.0
    for y, x in zip(outputs, inputs):
        x = x.double()
        inner += (y.double() * x).sum().item()
        square += (x * x).sum().item()
    return inner, square


def _key(program: TTTProgram, transforms, k: int) -> str:
    t = transforms[k]
    name = program.states[t.state].name
    same = [u for u in transforms if u.state == t.state]
    return name if len(same) == 1 else f"{name}#{same.index(t)}"


def _calibration_scale(program: TTTProgram, context: PassContext, transforms) -> dict:
    """Every transform's least-squares scale ``Σ⟨T(X), X⟩ / Σ‖X‖²`` on calibration data, as
    JSON (1 when every calibration increment is zero)."""
    nodes = [n for t in transforms for n in (t.output, t.source)]
    per_sample = update_chunk_values(context.calibration, program, nodes)
    folded = {}
    for k in range(len(transforms)):
        inner = square = 0.0
        for sample in per_sample:
            i, q = _projections(sample[2 * k], sample[2 * k + 1])
            inner, square = inner + i, square + q
        folded[_key(program, transforms, k)] = inner / square if square > 0 else 1.0
    return folded


class RemoveMuon(Pass):
    """Replace Newton–Schulz and increment normalisations by a scalar factor (Step 6)."""

    name = "remove_muon"
    step = 6
    exact = False
    removes = "increment_transform"

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Make every transform of an increment its input times its calibration scale."""
        transforms = increment_transforms(program)
        if not transforms:
            return self.result("already_satisfied",
                               "no Newton–Schulz iteration or normalisation on any state's "
                               "increment")
        folded, mode = resolve_folds(context, self.name,
                                     lambda: _calibration_scale(program, context, transforms))
        removed = []
        for k, t in enumerate(transforms):
            key = _key(program, transforms, k)
            scale = float(folded_constant(folded, key, self.name, 1.0))
            where = op_at(t.core)
            new = scaled(program, t.source, scale, t.source)
            t.output.replace_all_uses_with(new)
            removed.append(f"the {t.kind} on {program.states[t.state].name}'s increment "
                           f"({where}): its input times {scale:.6g}")
        program.recompile()
        reason = "removed " + "; ".join(removed) + _how_folded(mode)
        program.notes.append(f"remove_muon: {reason}")
        return self.result("applied", reason, folded if mode in ("measure", "replay") else None)

    def ensures(self, program: TTTProgram) -> None:
        """No increment is orthogonalised or normalised any more."""
        if increment_transforms(program):
            raise AssertionError("remove_muon left a transform of an increment")


def _how_folded(mode: str) -> str:
    return {"unfolded": " (unfolded: the increment as it is)",
            "no_calibration": " (no calibration data: the increment as it is, nothing folded)",
            "replay": " (replayed: the scale the transform imposed on the increments)",
            "measure": " (folded: the least-squares scale Σ⟨T(X), X⟩/Σ‖X‖² over the calibration "
                       "chunks)"}[mode]


remove_muon = register(RemoveMuon())

__all__ = ["RemoveMuon", "remove_muon", "increment_transforms", "IncrementTransform"]
