"""Step 4 of the paper: the per-token learning rate becomes a constant per head.

A learning-rate stream is a chunk stream whose value — the stream, or a map of it by
elementwise ops with constant operands, such as ``softplus(lr)`` or ``lr * 0.0 + 1.0`` — is a
per-token scalar factor of a state update: every reader is an elementwise product, on the way
to a state update, in which it broadcasts over the other operand's trailing (feature) axis
(``η_t · v_t``, ``φ(k_t)ᵀ · η_t``, ``η_t · k_tᵀv_t``). Streams the roles name ``q``, ``k`` or
``momentum`` are never taken for one, nor a factor of the state itself (a decay ``α_t ⊙ S``,
GLA's gate, gated DeltaNet's ``α``): a forgetting gate is no learning rate.

Each learning-rate value is replaced by a constant: its calibration mean over the rows of the
loop (axis 0: the batch, or batch × heads when the heads are folded into it), the tokens and the
chunks that update, kept apart along every other axis (a heads axis of its own). With heads
folded into axis 0 the constant is one number: a per-row constant would depend on the batch
size. Unfolded (``fold=False``) the learning rate becomes 1. A learning rate that is already a
constant expression (``lr * 0.0 + 1.0``) is folded exactly, from the graph. Not exact: a model
trained with per-token rates computes something else with a constant one.
"""
from __future__ import annotations

import re

import torch
import torch.fx

from ..analysis.dependence import node_shape, op_name
from ..analysis.op_vocabulary import ADDITIVE, COPIES, ELEMENTWISE_FUNCTIONS, SCALINGS
from ..analysis.roles import VIEW_OPS
from ..analysis.rules import constant_value
from ..ir import TTTProgram, ancestors, descendants, op_at
from .base import Pass, PassContext, PassResult, register
from .folding import folded_constant, replace_with_constant, resolve_folds, update_chunk_values

#: Elementwise ops a learning rate may pass through (with constant other operands) before it
#: scales an update.
_ELEMENTWISE = ADDITIVE | SCALINGS | ELEMENTWISE_FUNCTIONS | COPIES
_EXCLUDED_ROLES = {"q", "k", "momentum"}


def _value_chain(stream: torch.fx.Node, live: set) -> torch.fx.Node:
    """The last node of the stream-only elementwise chain that starts at ``stream`` (users
    outside ``live``, which the graph's output does not depend on, aside)."""
    node = stream
    while len(users := [u for u in node.users if u in live]) == 1:
        (user,) = users
        if not _with_constants(user, node) or node_shape(user) != node_shape(node):
            break
        node = user
    return node


def _with_constants(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``user`` is an elementwise op of ``node`` and constants (``softplus(lr)``, ``lr / 32``)."""
    if user.op != "call_function" or op_name(user) not in _ELEMENTWISE:
        return False
    others = [a for a in user.all_input_nodes if a is not node]
    scalar_args = [a for a in (*user.args, *user.kwargs.values()) if not isinstance(a, torch.fx.Node)]
    return all(constant_value(a) is not None for a in others) and all(
        isinstance(a, (int, float, bool, torch.dtype, torch.device, torch.layout,
                       torch.memory_format, type(None))) for a in scalar_args)


def _live(program: TTTProgram) -> set[torch.fx.Node]:
    """The body's nodes its outputs depend on: not the loss value a traced ``autograd.grad``
    computes beside its gradient and leaves unread."""
    return ancestors(program.body.graph.output_node())


def _readers(node: torch.fx.Node, live: set | None = None, through_constants: bool = False
             ) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(operand, op)`` for every non-view op reading ``node`` through view ops (in ``live``,
    when given), and with ``through_constants`` through elementwise ops with constants too
    (a traced backward divides a broadcast rate by the mean's count)."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if live is not None and user not in live:
                continue
            if user.op == "call_function" and (op_name(user) in VIEW_OPS or (
                    through_constants and _with_constants(user, n))):
                stack.append(user)
            else:
                found.append((n, user))
    return found


def _unexpanded(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` before the ``expand`` ops that broadcast it explicitly (as a traced backward
    broadcasts a per-token weight of the loss over the features), and the elementwise ops with
    constants after them (whichever operand the constant is: a traced backward multiplies the
    loss's broadcast ones by the weight)."""
    while node.op == "call_function":
        varying = [a for a in node.all_input_nodes if constant_value(a) is None]
        if op_name(node) == "expand":
            node = node.all_input_nodes[0]
        elif len(varying) == 1 and _with_constants(node, varying[0]):
            node = varying[0]
        else:
            return node
    return node


def _broadcasts_as_factor(operand: torch.fx.Node, mul: torch.fx.Node,
                          value: torch.fx.Node | None = None) -> bool:
    """``operand`` is a per-token scalar factor in ``mul``: size 1 on its trailing (feature)
    axis — or a view of ``value``, whose trailing axis is, laid out otherwise (``ηᵀ · vᵀ`` with
    ``η`` of ``[B, C, 1]``) —, broadcast over some axis of the other operand (its features:
    ``η · v``, or a key's column ``η · kᵀ``), and every axis it has of its own the other operand
    has too."""
    args = [a for a in mul.args[:2]]
    if args.count(operand) != 1:
        return False
    other = args[1] if args[0] is operand else args[0]
    mine, theirs = node_shape(_unexpanded(operand)), node_shape(other)
    if mine is None or theirs is None or not mine or not theirs:
        return False
    scalar = node_shape(value) if value is not None else None
    if mine[-1] != 1 and not (scalar and scalar[-1] == 1 and _numel(scalar) == _numel(mine)):
        return False
    pairs = list(zip(reversed(mine), reversed(theirs)))
    if not any(a == 1 and b > 1 for a, b in pairs):
        return False
    if any(a > 1 and a != b for a, b in pairs):
        return False
    return len(mine) <= len(theirs) or all(s == 1 for s in mine[: len(mine) - len(theirs)])


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _update_nodes(program: TTTProgram) -> set[torch.fx.Node]:
    outs, ins = program.state_outputs(), program.state_inputs()
    return set().union(*(ancestors(o) for o, i in zip(outs, ins)
                         if isinstance(o, torch.fx.Node) and o is not i))


def _scales_updates(value: torch.fx.Node, updates: set[torch.fx.Node], live: set) -> bool:
    """Every reader of ``value`` is a product on the way to an update, where it is a factor."""
    readers = _readers(value, live, through_constants=True)
    return bool(readers) and all(
        op.op == "call_function" and op_name(op) == "mul" and op in updates
        and _broadcasts_as_factor(operand, op, value) for operand, op in readers)


def learning_rates(program: TTTProgram) -> list[tuple[int, torch.fx.Node]]:
    """``(stream index, value node)`` of every learning-rate stream (see the module docstring)."""
    updates, live, states = _update_nodes(program), _live(program), _state_views(program)
    found = []
    for i, stream in enumerate(program.stream_inputs()):
        spec = program.streams[i] if i < len(program.streams) else None
        if spec is None or spec.role in _EXCLUDED_ROLES or not stream.users:
            continue
        value = _value_chain(stream, live)
        if _scales_updates(value, updates, live) and not _scales_a_state(value, live, states):
            found.append((i, value))
    return found


def constant_rates(program: TTTProgram) -> list[str]:
    """Loop invariants (not stream sources) that scale an update the way a learning rate does:
    a rate constant over the tokens, such as a learned one per head."""
    updates, live = _update_nodes(program), _live(program)
    sources = {s.source for s in program.streams}
    return [program.invariants[i].name for i, node in enumerate(program.invariant_inputs())
            if i not in sources and node.users
            and _scales_updates(_value_chain(node, live), updates, live)]


def computed_rates(program: TTTProgram) -> list[torch.fx.Node]:
    """Per-token factors of an update that the loop body computes from its streams through more
    than elementwise ops with constants (TTT-Linear's learned rate ``x_i · w``, projected per
    mini-batch): rates this pass does not fold. The first node of each such factor's chain."""
    updates, live, states = _update_nodes(program), _live(program), _state_views(program)
    state_dep = descendants(program.body.graph, program.state_inputs())
    stream_dep = descendants(program.body.graph, program.stream_inputs())
    found = []
    for node in program.body.graph.nodes:
        if node.op != "call_function" or node in state_dep or node not in live \
                or op_name(node) in VIEW_OPS or node not in stream_dep:
            continue
        shape = node_shape(node)
        if not shape or shape[-1] != 1 or any(a in found for a in node.all_input_nodes):
            continue
        if program.chunk_size > 1 and program.chunk_size not in shape[:-1]:
            continue            # one number per chunk (a momentum gate's mean), not per token
        value = _value_chain(node, live)
        if _scales_updates(value, updates, live) and not _scales_a_state(value, live, states):
            found.append(node)
    return found


def _state_views(program: TTTProgram) -> set[torch.fx.Node]:
    """The carried states' inputs and the views of them."""
    views = set(program.state_inputs())
    for n in program.body.graph.nodes:
        if n.op == "call_function" and op_name(n) in VIEW_OPS and n.args and n.args[0] in views:
            views.add(n)
    return views


def _scales_a_state(value: torch.fx.Node, live: set, states: set) -> bool:
    """Whether ``value`` multiplies a carried state itself (``states``: ``_state_views``): a
    decay or momentum coefficient, not a rate of the new data."""
    return any(a in states for operand, op in _readers(value, live, through_constants=True)
               for a in op.all_input_nodes if a is not operand)


def where(value: torch.fx.Node) -> str:
    """Where a learning rate is read: the value's own op, or for a bare stream its first
    reader."""
    if value.op != "placeholder":
        return op_at(value)
    readers = _readers(value)
    return op_at(readers[0][1]) if readers else value.name


def lr_like_streams(program: TTTProgram, found) -> list[int]:
    """Streams the roles call ``lr`` that are read but are not learning rates by the test above."""
    taken = {i for i, _ in found}
    return [i for i, (spec, node) in enumerate(zip(program.streams, program.stream_inputs()))
            if spec.role == "lr" and node.users and i not in taken]


#: A stream named like a learning rate in the user's code (``lr``, ``lr1``, ``eta``, ``ttt_lr``).
_RATE_NAME = re.compile(r"(^|_)(lr|lrs|eta|etas|learning_rate|step_size)\d*(_\d+)?$")


def rates_by_name(program: TTTProgram) -> list[str]:
    """Streams the user's code names as learning rates (``lr0``, ``eta``) that the roles do not
    take for one, read by a state update: a rate per token and feature (LaCT's ``lr: [b, l,
    d]``) scales the values elementwise, and is no per-token factor."""
    feeds = _update_nodes(program)
    return [spec.name for spec, node in zip(program.streams, program.stream_inputs())
            if spec.role not in _EXCLUDED_ROLES and _RATE_NAME.search(spec.name)
            and node in feeds]


def _read_at(program: TTTProgram, streams: list[int]) -> str:
    """The streams named as the report names them, each with the first op of the loop body
    reading it (a scan's carried values have no name in the user's code, only a line)."""
    inputs = program.stream_inputs()
    return ", ".join(
        f"{program.streams[i].name} (read by {op_at(next(iter(inputs[i].users)))})"
        if inputs[i].users else program.streams[i].name for i in streams)


def _unfolded_by_name(program: TTTProgram, named: list[str]) -> str:
    """Why streams named as learning rates are left per token: a value per token and feature
    is no per-token factor; one value per token is, but reaches the update otherwise than as a
    factor of the increment this pass reads."""
    shapes = {spec.name: (spec, node_shape(node))
              for spec, node in zip(program.streams, program.stream_inputs())}
    wide = [n for n in named if _has_features(*shapes[n])]
    scalar = [n for n in named if n not in wide]
    why = []
    if wide:
        why.append(f"stream(s) {', '.join(wide)}, named as learning rates, scale the update "
                   "with a value per token and feature, not a per-token factor (one per token "
                   "or head) that absorb_lr folds")
    if scalar:
        why.append(f"stream(s) {', '.join(scalar)}, named as learning rates, hold one value per "
                   "token but reach the update otherwise than as a factor of each token's "
                   "increment (through a loss weighted per token and differentiated under a "
                   "transform, say), which is what absorb_lr reads and folds")
    return "; ".join(why) + ": left unchanged, so this level keeps them"


def _has_features(spec, shape) -> bool:
    """Whether a stream's chunk holds more than one value per token: an axis after its tokens
    longer than 1 (a rate per token and feature)."""
    if shape is None:
        return True
    return any(n > 1 for n in shape[spec.axis % len(shape) + 1:])


def rates_computed_from_tokens(program: TTTProgram) -> list[str]:
    """Loop invariants the user's code names as learning rates (TTT-Linear's ``lr_weight``,
    read as ``lr``) that the loop body combines with the tokens on the way to a state update:
    a rate computed per token in the body (``σ(x·w + b)``), in a form this pass does not fold."""
    feeds = _update_nodes(program)
    from_tokens = descendants(program.body.graph, program.stream_inputs())
    return [spec.name for spec, node in zip(program.invariants, program.invariant_inputs())
            if _RATE_NAME.search(spec.name) and node in feeds
            and any(n in from_tokens and n in feeds
                    for n in descendants(program.body.graph, [node]))]


def _token_axis(program: TTTProgram, i: int, value: torch.fx.Node) -> int | None:
    spec = program.streams[i]
    return None if spec.per_token else spec.axis % len(node_shape(value))


def _calibration_mean(program: TTTProgram, context: PassContext, lrs) -> dict:
    """Every learning rate's calibration mean over rows, tokens and update chunks, as JSON."""
    per_sample = update_chunk_values(context.calibration, program, [v for _, v in lrs])
    folded = {}
    for k, (i, value) in enumerate(lrs):
        chunks = [x for sample in per_sample for x in sample[k]]
        stacked = torch.stack([c.double() for c in chunks])          # [chunks, *shape]
        axes = [0, 1] + ([] if (t := _token_axis(program, i, value)) is None else [t + 1])
        mean = stacked.mean(dim=sorted(set(axes)), keepdim=True)[0]
        folded[program.streams[i].name] = mean.item() if mean.numel() == 1 else mean.tolist()
    return folded


def _constant(entry):
    return float(entry) if isinstance(entry, (int, float)) else torch.tensor(entry,
                                                                            dtype=torch.float64)


class AbsorbLr(Pass):
    """Replace every per-token learning rate by a constant per head (Step 4)."""

    name = "absorb_lr"
    step = 4
    exact = False

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Fold every learning-rate stream into a constant (its calibration mean per head)."""
        lrs = learning_rates(program)
        if not lrs:
            left = lr_like_streams(program, lrs)
            if left:
                return self.result("not_applicable",
                                   f"stream(s) {_read_at(program, left)} look like learning "
                                   "rates but do not scale a state update as a per-token "
                                   "factor; left unchanged, so this level keeps them")
            named = rates_by_name(program)
            if named:
                return self.result("not_applicable", _unfolded_by_name(program, named))
            constant = constant_rates(program)
            if constant:
                return self.result("already_satisfied",
                                   f"the learning rate {', '.join(constant)} is constant over the "
                                   "tokens (read unchanged by every chunk)")
            ins, outs = program.state_inputs(), program.state_outputs()
            if not any(o is not i for i, o in zip(ins, outs)):
                return self.result("not_applicable", "the loop updates no carried state")
            computed = computed_rates(program)
            if computed:
                return self.result(
                    "not_applicable",
                    f"the per-token rate ({', '.join(op_at(n) for n in computed)}) is "
                    "computed in the loop body from its inputs, and absorb_lr folds rates that "
                    "are streams (or elementwise maps of them): left unchanged, so this level "
                    "keeps the per-token rate. Compute the rate before the loop on the whole "
                    "sequence and slice it per chunk as the keys are sliced, to have it folded")
            from_tokens = rates_computed_from_tokens(program)
            if from_tokens:
                return self.result(
                    "not_applicable",
                    f"the loop body combines {', '.join(from_tokens)} (named as learning "
                    "rates) with the tokens into a per-token rate (such as σ(x·w + b)), a form "
                    "absorb_lr does not fold: left unchanged, so this level keeps the per-token "
                    "rate")
            return self.result("already_satisfied", "no stream or loop invariant scales a state "
                                                    "update as a per-token factor: the rate, if "
                                                    "any, is a constant of the code or no factor "
                                                    "of the update")
        exact_lrs = [(i, v, c) for i, v in lrs if (c := constant_value(v)) is not None]
        data_lrs = [(i, v) for i, v in lrs if constant_value(v) is None]
        done = []
        for i, value, c in exact_lrs:
            place = where(value)
            how = replace_with_constant(program, value, c, "lr_constant")
            done.append(f"{program.streams[i].name} is the constant {c:.6g} ({place}), written "
                        f"as {how}")
        if not data_lrs:
            reason = "the learning rate is constant: " + "; ".join(done)
            program.notes.append(f"absorb_lr: {reason}")
            return self.result("already_satisfied", reason)
        folded, mode = resolve_folds(context, self.name,
                                     lambda: _calibration_mean(program, context, data_lrs))
        replaced = []
        for i, value in data_lrs:
            name = program.streams[i].name
            place = where(value)
            constant = _constant(folded_constant(folded, name, self.name, 1.0))
            how = replace_with_constant(program, value, constant, f"lr_{name}")
            replaced.append(f"{name} (read by {place}) by {how}")
        reason = "replaced the per-token learning rate " + "; ".join(replaced) + \
            _how_folded(mode, program, data_lrs)
        if done:
            reason += "; " + "; ".join(done)
        program.notes.append(f"absorb_lr: {reason}")
        return self.result("applied", reason, folded if mode in ("measure", "replay") else None)

    def ensures(self, program: TTTProgram) -> None:
        """Every learning rate left is a constant."""
        left = [program.streams[i].name for i, v in learning_rates(program)
                if constant_value(v) is None]
        if left:
            raise AssertionError(f"absorb_lr left per-token learning rates: {left}")


def _how_folded(mode: str, program: TTTProgram, lrs) -> str:
    if mode == "unfolded":
        return " (unfolded: the learning rate is 1)"
    if mode == "no_calibration":
        return " (no calibration data: the learning rate is 1, nothing folded)"
    verb = "replayed" if mode == "replay" else "folded"
    rows = [program.streams[i].name for i, v in lrs
            if all(s == 1 for k, s in enumerate(node_shape(v))
                   if k not in (0, _token_axis(program, i, v)))]
    if not rows:
        return f" ({verb}: its calibration mean per head over rows, tokens and chunks)"
    return (f" ({verb}: its calibration mean over all rows, tokens and chunks — "
            f"{', '.join(rows)} has no heads axis besides the rows (batch × heads when the "
            "heads are folded into them), and a per-row constant would depend on the batch "
            "size)")


absorb_lr = register(AbsorbLr())

__all__ = ["AbsorbLr", "absorb_lr", "learning_rates", "constant_rates"]
