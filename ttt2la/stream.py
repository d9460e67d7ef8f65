"""Stateful decoding: a converted layer continues a sequence from the state a previous call left.

``y, state = layer(x, ttt_state=state, return_ttt_state=True)`` runs the piece ``x`` from
``state`` (``None``: the layer's initial fast weights) and returns the state after it, so that
feeding a sequence in pieces of any sizes gives the outputs of feeding it whole.

A chunked layer updates its fast weights once per chunk of ``C`` tokens, so a piece that ends
inside a chunk cannot fold that chunk into the state yet — and an apply-then-update layer
(LaCT) does not fold its last chunk even when it is full, since the whole sequence would only
apply it. The state therefore holds the fast weights and momentum *at the start of the open
chunk* together with that chunk's tokens as the loop reads them (its slice of every stream
source: q, k, v, learning rates, ...). The next piece is appended to those tokens and the open
chunk is recomputed from its start, so every chunk the loop sees is the chunk the whole
sequence would give it. A per-token layer has no open chunk, unless it reads each token
before writing it and its last token is only read (the delta rule's read-then-write form): its
last token stays open the same way, one token long. Code that pads each piece to whole chunks
before the loop has the loop read padding after the piece's tokens: the outputs come from the
padded run, the state from the tokens alone, which the next piece's tokens then complete.

``Stream(model)`` carries the state of every converted layer of a whole model from one call
to the next.

Only the loop carries state: the code around it must treat tokens one by one (projections,
norms over features, the output projection). ``streaming_problem`` checks that once per layer
by perturbing single tokens; a layer whose code mixes tokens across the sequence outside the
loop raises ``StreamingError``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.utils._pytree as pytree

from .errors import ConversionError, StreamingError
from .ir import TTTProgram
from .lowering.chunking import stream_length
from .lowering.executors import lower
from .lowering.lift import LiftedPlan
from .testing import TOLERANCE, rel_rms_error


@dataclass(frozen=True, eq=False)
class TTTState:
    """The state one converted TTT layer carries from one call to the next.

    * ``names`` / ``roles`` / ``values``: the loop's carried states (fast weights — roles
      ``final`` and ``theta`` — and ``momentum``) as they are at the start of the open chunk,
      in the layout the loop carries them (heads folded into the batch where the user's code
      folds them);
    * ``sources`` / ``open``: the open chunk's tokens, one tensor per sequence the loop slices
      chunks from (named like the loop's invariants), cut along that sequence's token axis;
      ``open_tokens`` is their number (0 for per-token layers that write every token they
      read, 1 for those whose last token is only read, ``1..C`` for LaCT's apply-then-update
      chunks);
    * ``tokens``: how many tokens the layer has seen since the state started.
    """

    names: tuple[str, ...]
    roles: tuple[str, ...]
    values: tuple[torch.Tensor, ...]
    sources: tuple[str, ...]
    open: tuple[torch.Tensor, ...]
    open_tokens: int
    tokens: int

    @property
    def fast_weights(self) -> dict[str, torch.Tensor]:
        """The fast weights (roles ``final`` and ``theta``) by name."""
        return {n: v for n, r, v in zip(self.names, self.roles, self.values)
                if r in ("final", "theta")}

    @property
    def momentum(self) -> dict[str, torch.Tensor]:
        """The momentum buffers by name."""
        return {n: v for n, r, v in zip(self.names, self.roles, self.values) if r == "momentum"}

    def detach(self) -> "TTTState":
        """The same state cut from the autograd graph (to decode without keeping history)."""
        return TTTState(self.names, self.roles, tuple(v.detach() for v in self.values),
                        self.sources, tuple(t.detach() for t in self.open), self.open_tokens,
                        self.tokens)


def _source_axes(program: TTTProgram, invariants: Sequence[torch.Tensor]) -> dict[int, int]:
    """Invariant index -> token axis, for every sequence the loop slices chunks from."""
    axes: dict[int, int] = {}
    for spec in program.streams:
        axes.setdefault(spec.source, spec.axis % invariants[spec.source].dim())
    return axes


def _narrow(invariants, axes: dict[int, int], start: int, length: int) -> list:
    return [x.narrow(axes[i], start, length) if i in axes else x
            for i, x in enumerate(invariants)]


def _check_compatible(state: TTTState, program: TTTProgram, states0, invariants, axes,
                      where: str) -> None:
    """Refuse a ``ttt_state`` this layer did not return at this batch size, or one altered
    since: its names, values and open chunk must be what the layer's own state holds."""
    names = tuple(s.name for s in program.states)
    if state.names != names:
        raise StreamingError(
            f"the ttt_state passed to {where} belongs to another layer (its states are "
            f"{', '.join(map(str, state.names))}; this layer carries {', '.join(names)}). Pass "
            "each layer the state it returned, or ttt_state=None to start over.")
    _check_tensors("values", state.values, states0, where)
    for name, v, s0 in zip(names, state.values, states0):
        if v.shape != s0.shape:
            raise StreamingError(_shape_mismatch(name, tuple(v.shape), tuple(s0.shape), where))
    _check_open(state, program, invariants, axes, where)


def _altered(what: str, where: str) -> StreamingError:
    return StreamingError(f"the ttt_state passed to {where} {what}, which no state this layer "
                          "returns holds: pass the ttt_state the layer returned, unaltered, or "
                          "ttt_state=None to start over.")


def _check_tensors(field: str, held, like, where: str) -> None:
    """``held``: as many real tensors as ``like`` holds, on its device."""
    if not isinstance(held, (tuple, list)) or len(held) != len(like):
        raise _altered(f"has {field} {type(held).__name__} of "
                       f"{len(held) if isinstance(held, (tuple, list)) else '?'} item(s) where "
                       f"{len(like)} tensor(s) belong", where)
    for i, (t, ref) in enumerate(zip(held, like)):
        if not isinstance(t, torch.Tensor) or t.device != ref.device or t.layout != ref.layout:
            found = type(t).__name__ if not isinstance(t, torch.Tensor) else \
                f"a tensor on {t.device}"
            raise _altered(f"has {field}[{i}] {found} where this call's are on {ref.device}",
                           where)


def _check_open(state: TTTState, program: TTTProgram, invariants, axes, where: str) -> None:
    """The open chunk: one tensor per sliced sequence, ``open_tokens`` long on its token axis
    (at most a chunk), the rest of its shape and its dtype the sequence's."""
    sources = sorted(axes)
    names = tuple(program.invariants[i].name for i in sources)
    roles = tuple(s.role for s in program.states)
    if tuple(state.sources) != names or tuple(state.roles) != roles:
        raise _altered(f"names its sequences {state.sources} and roles {state.roles} (this "
                       f"layer's are {names} and {roles})", where)
    n = state.open_tokens
    bound = 1 if any(s.per_token for s in program.streams) else program.chunk_size
    if type(n) is not int or not 0 <= n <= bound or type(state.tokens) is not int \
            or state.tokens < n:
        raise _altered(f"says {state.open_tokens!r} open token(s) of {state.tokens!r} seen "
                       f"(at most {bound} open, never more than seen)", where)
    like = [invariants[i].narrow(axes[i], 0, 0) for i in sources]
    _check_tensors("open", state.open, like, where)
    for i, t, ref in zip(sources, state.open, like):
        want = list(ref.shape)
        want[axes[i]] = n
        if list(t.shape) != want or t.dtype != ref.dtype:
            raise _altered(f"holds an open chunk of {program.invariants[i].name} of "
                           f"{_described(t.dtype, t.shape)} where {n} token(s) are "
                           f"{_described(ref.dtype, want)}", where)


def _described(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).replace('torch.', '')} {tuple(shape)}"


def _shape_mismatch(name: str, held: tuple, needed: tuple, where: str) -> str:
    """Why a state ``held`` cannot continue where this call needs ``needed``: the batch size
    alone changed (the sizes after the first agree), or the state is another layer's."""
    found = (f"the ttt_state passed to {where} holds {name} of shape {held}, but this call "
             f"needs {needed}")
    if len(held) == len(needed) and held[1:] == needed[1:]:
        return (f"{found}: the batch size changed between calls. Continue a state at the batch "
                "size it was made with, or start over with ttt_state=None.")
    return (f"{found}: it holds the shapes of another layer whose state has the same names "
            "(its sizes differ beyond the batch). Pass each layer the ttt_state that layer "
            "returned, or start over with ttt_state=None.")


def _open_tail(program: TTTProgram, length: int, where: str) -> int:
    """How many of the piece's last tokens stay open: the tokens of a chunk the loop has not
    folded into its state. A loop whose last chunk (or, per token, last token) is only read
    never folds it, so that chunk stays open even when it is full — else the next piece would
    start from a state missing its update."""
    per_token = any(s.per_token for s in program.streams)
    C = 1 if per_token else program.chunk_size
    if program.last_chunk == "apply_only":
        tail = length - (math.ceil(length / C) - 1) * C         # 1..C: the last chunk stays open
    else:
        tail = length % C
    if tail and tail != C and program.order == "inclusive":
        raise StreamingError(
            f"{where} reads each chunk's outputs through the fast weights updated with the "
            f"whole chunk (update, then apply; chunk size {C}), so the outputs of an unfinished "
            f"chunk change when its remaining tokens arrive: this piece ends {tail} token(s) "
            f"into a chunk. Feed pieces that end on a chunk boundary (multiples of {C} tokens).")
    return tail


def _states_after(finals: list, before: list, program: TTTProgram, where: str) -> list:
    """Every carried state after a run of the plan. A plan may leave out (``None``) a state
    the loop never changes — it keeps its value — but a state the loop updates and the plan
    does not return cannot be continued: the next piece would start from a stale value."""
    ins, outs = program.state_inputs(), program.state_outputs()
    after = []
    for spec, f, s, i, o in zip(program.states, finals, before, ins, outs):
        if f is None and o is not i:
            raise StreamingError(
                f"{where} updates its state {spec.name} in the loop, but the plan that runs it "
                "returns no value for it after a piece, so a next piece could not start from "
                "it. Run whole sequences, or convert with backend='naive' to carry it.")
        after.append(s if f is None else f)
    return after


@dataclass
class StreamCall:
    """One stateful call of a converted layer: the state in, filled with the state out."""

    state_in: TTTState | None
    tokens: int             # the piece's tokens, as the caller passed them
    state_out: TTTState | None = None


def stateful_plan(loop) -> object:
    """The plan a stateful call runs: the layer's own, unless it cannot take or return every
    carried state (the runtime op starts momentum at zero and returns only the final fast
    weights); then the generic parallel schedule of the same program, exact as well."""
    plan = loop.plan
    if isinstance(plan, LiftedPlan) and plan.lifted.m is not None:
        cached = getattr(loop, "_stateful_plan", None)
        if cached is None:
            cached = lower(loop.program, None, backend="torch", schedule=plan.schedule)
            loop._stateful_plan = cached
        return cached
    return plan


def advance(plan, program: TTTProgram, states0: list, invariants: list, call: StreamCall,
            where: str) -> tuple[list, list]:
    """Run ``program`` on one piece from ``call.state_in``: its outputs (the piece's tokens
    only) and final states as the whole sequence would give them; the state after the piece is
    left in ``call.state_out``."""
    axes = _source_axes(program, invariants)
    sources = sorted(axes)
    state_in, n_open, seen = call.state_in, 0, 0
    if state_in is not None:
        _check_compatible(state_in, program, states0, invariants, axes, where)
        states0 = [v.to(s.dtype) for v, s in zip(state_in.values, states0)]
        invariants = list(invariants)
        for i, prefix in zip(sources, state_in.open):
            invariants[i] = torch.cat([prefix, invariants[i]], dim=axes[i])
        n_open, seen = state_in.open_tokens, state_in.tokens
    length = stream_length(program, list(invariants))
    real = n_open + call.tokens
    tail = _open_tail(program, real, where)
    if length != real:
        outputs, finals, carried = _padded_piece(plan, program, states0, invariants, axes,
                                                 length, real, tail, where)
    elif program.last_chunk == "apply_only" or tail == 0:
        outputs, finals = plan(states0, invariants)
        carried = _states_after(finals, states0, program, where)
    else:
        outputs, finals, carried = _open_chunk_apart(plan, program, states0, invariants, axes,
                                                     length, tail, where)
    outputs = [o.narrow(spec.axis % o.dim(), n_open, length - n_open)
               for o, spec in zip(outputs, program.outputs)]
    call.state_out = TTTState(
        names=tuple(s.name for s in program.states), roles=tuple(s.role for s in program.states),
        values=tuple(carried),
        sources=tuple(program.invariants[i].name for i in sources),
        open=tuple(invariants[i].narrow(axes[i], real - tail, tail) for i in sources),
        open_tokens=tail, tokens=seen + call.tokens)
    return outputs, finals


def _open_chunk_apart(plan, program, states0, invariants, axes, length, tail, where):
    """A piece whose last ``tail`` tokens open a chunk the loop folds in when it is full: the
    whole chunks run first, the state after them is carried, the open chunk runs from it."""
    full = length - tail
    mid = states0
    head_outputs = []
    if full:
        head_outputs, head_finals = plan(states0, _narrow(invariants, axes, 0, full))
        mid = _states_after(head_finals, states0, program, where)
    tail_outputs, finals = plan(mid, _narrow(invariants, axes, full, tail))
    finals = _states_after(finals, mid, program, where)
    outputs = tail_outputs if not full else [
        torch.cat([a, b], dim=spec.axis % a.dim())
        for a, b, spec in zip(head_outputs, tail_outputs, program.outputs)]
    return outputs, finals, mid


def _padded_piece(plan, program, states0, invariants, axes, length, real, tail, where):
    """A piece the code before the loop pads to whole chunks (``F.pad`` then a view as chunks):
    the loop reads ``length`` tokens, the first ``real`` of them the sequence's. The outputs
    come from the padded run, as the code computes them; the carried state from the sequence's
    tokens alone, since the next piece's tokens, not padding, complete the open chunk."""
    if length < real:
        raise StreamingError(
            f"{where} reads {length} tokens of a piece of {real}: the code before the loop "
            "drops tokens, so the state after this piece would miss them. Run whole sequences.")
    outputs, finals = plan(states0, invariants)
    folded = real if program.last_chunk == "apply_only" else real - tail
    carried = states0
    if folded:
        _, prefix_finals = plan(states0, _narrow(invariants, axes, 0, folded))
        carried = _states_after(prefix_finals, states0, program, where)
    return outputs, finals, carried


class WholeSequenceCheck:
    """A stream's outputs against the model run on the whole sequence, once per stream: the
    first two pieces of a sequence, streamed, against one call on both. A module outside the
    converted layers that mixes tokens — softmax attention, a convolution over the sequence —
    keeps no state a stream carries, so it would see each piece alone, and the outputs would
    differ from the whole sequence's without a word. Not checked in training mode, where
    dropout draws other values for each call."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.done = False
        self.pieces: list[tuple] = []

    def for_model(self, model: torch.nn.Module) -> "WholeSequenceCheck":
        """The same check, where it stands, for a stream on ``model`` (a fork's, a copy's)."""
        other = WholeSequenceCheck(model)
        other.done, other.pieces = self.done, list(self.pieces)
        return other

    def check(self, args: tuple, kwargs: dict, y, first: bool) -> None:
        if self.done or self.model.training:
            return
        if first:
            self.pieces = []
        same = [id(t) for t in pytree.tree_leaves((args, kwargs))]
        self.pieces.append((*_kept((args, kwargs, y)), same))   # a caller may reuse buffers
        if len(self.pieces) < 2:
            return
        pieces, self.pieces, self.done = self.pieces, [], True
        joined = _joined([(a, k) for a, k, _, _ in pieces], [s for *_, s in pieces])
        if joined is None:
            return                          # pieces that are not cut along axis 1
        try:
            with torch.no_grad():
                whole = self.model(*joined[0], **joined[1])
        except Exception:                   # the model takes no such call: nothing to compare
            return
        got, want = _second_piece(pieces, whole)
        if got is None:
            return
        err = rel_rms_error(got, want)
        if not err <= max(1e-3, 2 * TOLERANCE.get(want.dtype, 1e-5)):
            raise StreamingError(
                f"{type(self.model).__name__} streamed in pieces gives other outputs than on the "
                f"whole sequence (relative RMS {err:.3g} on its second piece): a module outside "
                "its converted TTT layers mixes tokens (softmax attention, a convolution over "
                "the sequence), and a stream carries the TTT layers' state only, so that module "
                "sees each piece alone. Run the model on whole sequences, or carry that "
                "module's state (its keys and values, its last inputs) yourself.")


def _kept(value):
    """``value`` with its tensors copied, detached."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                           value)


def _tokens(args: tuple, kwargs: dict) -> int:
    """The length of a piece: axis 1 of its first tensor of two or more axes (0: none)."""
    return next((t.shape[1] for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.dim() >= 2), 0)


def _joined(calls: list[tuple], ids: list[list[int]]):
    """The pieces' ``(args, kwargs)`` as one call: a tensor every piece passes as the same
    object, unchanged (a context, a style vector), once, and the others joined along axis 1
    (``ids``: each piece's leaves' identities when it was called); ``None`` where they do not
    join so (other structures, other non-tensor values, tensors of fewer axes)."""
    flat = [pytree.tree_flatten(call) for call in calls]
    if any(spec != flat[0][1] for _, spec in flat):
        return None
    out = []
    for leaves, idents in zip(zip(*(leaves for leaves, _ in flat)), zip(*ids)):
        tensors = all(isinstance(t, torch.Tensor) for t in leaves)
        if tensors and len(set(idents)) == 1 and all(
                t.shape == leaves[0].shape and torch.equal(t, leaves[0]) for t in leaves):
            out.append(leaves[0])
        elif tensors and all(t.dim() >= 2 for t in leaves):
            out.append(torch.cat(leaves, 1))
        elif not tensors and all(not isinstance(t, torch.Tensor) and t == leaves[0]
                                 for t in leaves):
            out.append(leaves[0])
        else:
            return None
    return pytree.tree_unflatten(out, flat[0][1])


def _second_piece(pieces: list[tuple], whole):
    """The second piece's streamed output and what the whole call gives in its place: its
    tokens' outputs, or all of it where the model returns no axis of tokens (the last token's
    logits); ``(None, None)`` where the two do not line up."""
    got, want = _first_floating(pieces[1][2]), _first_floating(whole)
    if got is None or want is None:
        return None, None
    if got.shape == want.shape:
        return got, want
    n1, n2 = _tokens(*pieces[0][:2]), _tokens(*pieces[1][:2])
    if got.dim() >= 2 and want.dim() == got.dim() and got.shape[1] == n2 \
            and want.shape[1] == n1 + n2 and want.shape[2:] == got.shape[2:]:
        return got, want[:, n1:]
    return None, None


def _first_floating(out) -> torch.Tensor | None:
    """The first floating tensor among a model's outputs."""
    return next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                 and t.is_floating_point()), None)


def _copied(state: TTTState) -> TTTState:
    """``state`` with its tensors copied."""
    return TTTState(state.names, state.roles, tuple(v.clone() for v in state.values),
                    state.sources, tuple(t.clone() for t in state.open), state.open_tokens,
                    state.tokens)


class Stream:
    """Decode with a whole model piece by piece: ``stream(x)`` runs ``model`` on the next
    piece, every converted layer continuing from the state the previous call left.

        s = ttt2la.Stream(converted_lm)
        logits = s.stream(prompt_ids)          # [B, L] token ids in
        logits = s.stream(next_ids)            # continues where the prompt ended
        s.reset()                              # start a new sequence

    ``states`` maps each converted layer's path to its ``TTTState``; a layer the model runs
    more than once per call (weights shared across depth) carries one state per run, its
    later runs' under ``"path (run 2)"``, ``"path (run 3)"``, …. The model itself is untouched:
    outside ``stream`` it runs whole sequences as before.
    """

    def __init__(self, model: torch.nn.Module):
        from .converted import is_converted

        if not isinstance(model, torch.nn.Module):
            raise ConversionError(f"Stream takes a converted torch.nn.Module, got "
                                  f"{type(model).__name__}")
        self.model = model
        self.layers = {path: m for path, m in model.named_modules() if is_converted(m)}
        kept = [layer.module_path or f"the model ({type(model).__name__}) itself"
                for layer in getattr(getattr(model, "ttt2la_report", None), "layers", [])
                if layer.module_path not in self.layers]
        if kept:
            raise StreamingError(
                f"the TTT loop of {', '.join(kept)} was kept as the user wrote it (not "
                "reducible at this level, strict=False), and the user's loop restarts from its "
                "initial fast weights at every call, so the model cannot decode piece by piece. "
                "Convert at a level where every layer converts.")
        if not self.layers:
            raise StreamingError(
                f"{type(model).__name__} has no converted TTT layer, so there is no state to "
                "carry; convert it first with ttt2la.convert(model, ...)")
        self.states: dict[str, TTTState | None] = {p: None for p in self.layers}
        self._runs: dict[str, int] = {}         # each layer's runs in the call under way
        self._last_runs: dict[str, int] | None = None
        self._whole = WholeSequenceCheck(model)

    def fork(self) -> "Stream":
        """Another stream on the same model, continuing from where this one is (a beam's
        branch): the states are shared, as the prefix both continue is, and so is its autograd
        history; each stream advances on its own."""
        other = copy.copy(self)
        other.states, other._runs = dict(self.states), {}
        other._last_runs = None if self._last_runs is None else dict(self._last_runs)
        other._whole = self._whole.for_model(self.model)
        return other

    def __deepcopy__(self, memo) -> "Stream":
        """A copy of the model and a stream on it where this one is: the states' values are
        copied, cut from the autograd history of the pieces run so far, which belongs to the
        original model's parameters (``fork`` keeps it, on the same model)."""
        other = copy.copy(self)
        other.model = copy.deepcopy(self.model, memo)
        other.layers = {path: m for path, m in other.model.named_modules() if path in self.layers}
        other.states = {k: None if v is None else _copied(v.detach())
                        for k, v in self.states.items()}
        other._runs, other._last_runs = {}, None if self._last_runs is None else \
            dict(self._last_runs)
        other._whole = self._whole.for_model(other.model)
        return other

    def reset(self) -> None:
        """Forget every layer's state: the next ``stream`` call starts a new sequence."""
        self.states = {p: None for p in self.layers}
        self._last_runs = None

    @property
    def tokens(self) -> int:
        """Tokens seen since the last reset (by the first converted layer)."""
        first = next(iter(self.states.values()))
        return 0 if first is None else first.tokens

    def stream(self, *args, **kwargs):
        """``model(*args, **kwargs)`` on the next piece of the sequence. A call that fails
        advances nothing: layers that ran before the failing one keep the states they had, so
        the stream stays where the previous piece ended."""
        handles = []
        self._runs = dict.fromkeys(self.layers, 0)
        before = dict(self.states)
        try:
            for path, layer in self.layers.items():
                handles.append(layer.register_forward_pre_hook(self._pre(path), with_kwargs=True))
                handles.append(layer.register_forward_hook(self._post(path)))
            y = self.model(*args, **kwargs)
        except BaseException as e:
            self.states = before
            e.add_note("ttt2la.Stream: no layer's state advanced; the stream is where the "
                       "previous piece ended.")
            raise
        finally:
            for h in handles:
                h.remove()
        self._check_runs()
        try:
            self._whole.check(args, kwargs, y, first=self.tokens == _tokens(args, kwargs))
        except StreamingError:
            self.reset()
            raise
        return y

    __call__ = stream

    def _key(self, path: str) -> str:
        """Where the state of ``path``'s current run is kept."""
        run = self._runs[path]
        return path if run == 0 else f"{path} (run {run + 1})"

    def _pre(self, path: str):
        def hook(_module, args, kwargs):
            state = self.states.get(self._key(path))
            return args, {**kwargs, "ttt_state": state, "return_ttt_state": True}
        return hook

    def _post(self, path: str):
        def hook(_module, _args, output):
            y, state = output
            self.states[self._key(path)] = state
            self._runs[path] += 1
            return y
        return hook

    def _check_runs(self) -> None:
        """Each layer must run as often in every call of a sequence: the states of its runs are
        matched by their order."""
        runs, last = dict(self._runs), self._last_runs
        self._last_runs = runs
        changed = [p for p in runs if last is not None and runs[p] != last[p]]
        if changed:
            p = changed[0]
            self.reset()
            raise StreamingError(
                f"{p} ran {runs[p]} time(s) in this call of the model and {last[p]} in the "
                "previous one, so its states cannot be matched to its runs; the stream was "
                "reset. Run every layer as often in each piece of a sequence.")


__all__ = ["TTTState", "Stream", "StreamCall", "advance", "stateful_plan"]
