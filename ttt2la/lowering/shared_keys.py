"""Memories written with the final state's keys ride as extra value columns of its op.

Linear attention with its normaliser keeps two memories, ``S' = S + kᵀv`` and ``z' = z + k``, and
reads both with the same query: ``o = (q S) / (q·z + ε)``. ``z`` is one more column of ``S`` whose
value is always 1: ``[S | z]' = [S | z] + kᵀ[v | 1]`` and ``q [S | z] = [q S | q·z]``. A gated
memory (xLSTM's mLSTM: ``C' = f C + i kᵀv``, ``n' = f n + i k``) is the same with a column that
varies per token: ``n = Σ_s (decay) i_s k_s`` is the column of values ``i_s`` under keys ``k_s``. So
a state beside the final one is a *companion* when, per token,

* its update is ``z' = γ z + c_t·k``: the final state's decay ``γ`` (the same polynomial), the
  final state's key feature ``k`` itself, and a column value ``c_t`` holding one number per
  memory — a constant, or a product of per-token factors the loop computes without any state
  (``i_t``); which product it is follows how the final state's key was read (``k`` with the gate
  in its values: ``c_t = i_t``; ``i·k`` as its key: ``c_t = 1``), and the increment ``c_t·k`` is
  confirmed against the loop's own on random inputs, its state set to zero;
* the loop reads it only through ``q·z`` with the final state's query (confirmed the same way).

The op then runs once on values widened by one column ``c_t`` per companion; each companion's read
and final state are its columns of the op's output and final state. A loop over chunks (linear
attention written chunk by chunk, ``z' = z + Σ_chunk k``, read ``Q_chunk z``) is the same on the
block op with a constant column: its increment is the chunk's keys summed, times the column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..analysis.op_vocabulary import RELAYOUT_TARGETS
from ..ir import TTTProgram, ancestors, descendants
from .affine_update import Polynomial, as_polynomial, evaluate, factor_shape, times
from .executors import extract
from .precision import promoted, relative_error, samples

aten = torch.ops.aten


@dataclass(frozen=True)
class Companion:
    """A memory riding as a value column: its state's index, the column's value per token (one
    monomial ``((c, factors),)``: factor nodes while lifting, their indices among the lifted
    plan's factors after) and the node that reads it (``q·z``, in the loop's own layout: the
    state's batch axes, then ``units`` axes of size 1)."""

    index: int
    column: Polynomial
    read: torch.fx.Node
    units: int = 1

    def read_shape(self, state: torch.Tensor, tokens: int | None = None) -> tuple:
        """The read's shape beside a state of the run's batch size (a chunk loop's: ``tokens``
        queries, then axes of size 1)."""
        if tokens is None:
            return (*state.shape[:-1], *(1,) * self.units)
        return (*state.shape[:-1], tokens, *(1,) * (self.units - 1))


def companions(program: TTTProgram, others: list, up, key: torch.fx.Node,
               query: torch.fx.Node, query_rows: bool, accumulated,
               tokens: int | None = None) -> list[Companion] | None:
    """A ``Companion`` for each state of ``others`` (indices), or ``None`` when one is not.

    ``up`` is the final state's update (its decay ``gamma``, ``state_dep``), ``key`` / ``query``
    the nodes of its key feature and of its query (``query_rows``: tokens along the query's
    rows, as the op's ``φ(Q)`` takes them, else along its columns), ``accumulated`` lift's
    reading of a state's update as ``(γ, s, term)``; ``tokens``, in a loop over chunks, the
    key feature's axis of the chunk's tokens (a constant column only).
    """
    ins, outs = program.state_inputs(), program.state_outputs()
    found = []
    for i in others:
        # any state-free factor may decay a memory of keys, elementwise: whether it decays as
        # the final state does is checked on values (``_same_decay``)
        read = accumulated(program, ins[i], outs[i], up.state_dep,
                           lambda x, dep: factor_shape(x, dep) is not None)
        if read is None:
            return None
        gamma, step, term = read
        if len(step) != 1 or not _same_decay(program, up, gamma, ins[i], not query_rows):
            return None
        candidates = _peelings(step, term, up.state_dep) if tokens is None else [step]
        column = _column(program, ins[i], outs[i], candidates, key, tokens)
        if column is None:
            return None
        state = outs[i] if program.order == "inclusive" else ins[i]
        reader = _reader(program, state, up, query, query_rows,
                         None if tokens is None else program.chunk_size)
        if reader is None:
            return None
        units = reader.meta["val"].dim() - (state.meta["val"].dim() - 1)
        found.append(Companion(i, column, reader, units))
    return found


def _boundary(program: TTTProgram) -> list:
    return [*program.stream_inputs(), *program.invariant_inputs()]


def _evaluated(program: TTTProgram, boundary: list, outputs: list,
               zeros: set = frozenset()) -> list | None:
    """``outputs`` computed in float64 from random values of what they need in ``boundary``
    (zero for the nodes of ``zeros``)."""
    try:
        gm, inputs = extract(program.body, boundary, outputs)
    except RuntimeError:
        return None
    args = samples(inputs, 1, seed=3)
    if args is None:
        return None
    args = [torch.zeros_like(a) if n in zeros else a for n, a in zip(inputs, args)]
    try:
        with torch.no_grad():
            return list(promoted(gm)(*(a[0] for a in args)))
    except Exception:
        return None


def _peelings(step: Polynomial, term: torch.fx.Node, state_dep: set) -> list[Polynomial]:
    """The column values a companion's increment ``step·term`` may have, fewest factors first:
    ``step`` itself (``term`` is the key), then ``step`` times each further factor peeled off
    ``term`` — state-free nodes holding one number per memory (``i_t`` of ``i_t·k``)."""
    found, node = [step], term
    while (n := _unviewed(node)).target is aten.mul.Tensor:
        x, f = next(((x, f) for x, f in (n.args, n.args[::-1]) if _per_memory(f, x, state_dep)),
                    (None, None))
        if x is None:
            break
        found.append(times(found[-1], as_polynomial(f)))
        node = x
    return found


def _unviewed(n: torch.fx.Node) -> torch.fx.Node:
    """``n`` with the relayouts that keep its elements in place (views, copies) peeled off."""
    while isinstance(n, torch.fx.Node) and n.target in RELAYOUT_TARGETS:
        n = n.args[0]
    return n


def _per_memory(f, x, state_dep: set) -> bool:
    """Whether ``f`` scales ``x``, a memory's vector, by one state-free number per memory."""
    if not isinstance(f, torch.fx.Node) or not isinstance(x, torch.fx.Node) or f in state_dep:
        return False
    fv, xv = f.meta.get("val"), x.meta.get("val")
    return isinstance(fv, torch.Tensor) and isinstance(xv, torch.Tensor) and xv.dim() > 0 \
        and xv.shape[-1] > 1 and (fv.dim() == 0 or fv.shape[-1] == 1)


def _column(program: TTTProgram, state: torch.fx.Node, out: torch.fx.Node,
            candidates: list[Polynomial], key: torch.fx.Node,
            tokens: int | None = None) -> Polynomial | None:
    """The first of ``candidates`` whose product with the key feature is the companion's
    increment — ``out`` evaluated with ``state`` zero on random inputs, element for element,
    the column broadcast over the memory as the op's values will be (a chunk's keys summed
    along ``tokens`` first) — else ``None``."""
    if any(len(c) != 1 for c in candidates) or \
            (tokens is not None and any(fs for (_, fs), in candidates)):
        return None
    factors = list(dict.fromkeys(f for (_, fs), in candidates for f in fs))
    got = _evaluated(program, [*_boundary(program), state], [out, key, *factors], zeros={state})
    if got is not None and tokens is not None and got[1].dim() >= 2:
        got[1] = got[1].sum(tokens)
    if got is None or got[0].numel() != got[1].numel():
        return None
    increment, keys, values = got[0], got[1], {f: v.unsqueeze(0) for f, v in zip(factors, got[2:])}
    batch = tuple(state.meta["val"].shape[:-1])
    one = torch.zeros(1, dtype=torch.float64)
    for column in candidates:
        try:
            c = evaluate(column, values, one, batch, (1,))
            ours = (c * keys.reshape(1, *batch, -1)).reshape(-1)
        except RuntimeError:
            continue
        if ours.numel() == increment.numel() and \
                relative_error(ours - increment.reshape(-1), increment.reshape(-1)) < 1e-12:
            return column
    return None


def _same_decay(program: TTTProgram, up, gamma, state: torch.fx.Node, transposed: bool) -> bool:
    """Whether the companion ``state`` (``[..., Dk]``) decays as the final state's rows do:
    both coefficients evaluated on random inputs as ``[..., Dk, 1]`` (``affine_update.evaluate``,
    one sample)."""
    factors = list(dict.fromkeys(f for p in (up.gamma, gamma) for _, fs in p for f in fs))
    got = _evaluated(program, _boundary(program), factors) if factors else []
    if got is None:
        return False
    one = torch.zeros(1, dtype=torch.float64)
    *batch, rows, cols = program.state_inputs()[up.w].meta["val"].shape
    keys = cols if transposed else rows
    ours = evaluate(up.gamma, {f: v.unsqueeze(0) for f, v in zip(factors, got)}, one,
                    tuple(batch), (1, keys) if transposed else (keys, 1))
    ours = ours.mT if transposed else ours
    z_batch = tuple(state.meta["val"].shape[:-1])
    theirs = evaluate(gamma, {f: v.unsqueeze(0).unsqueeze(-1) for f, v in zip(factors, got)},
                      one, z_batch, (keys, 1))
    return ours.shape == theirs.shape and relative_error(ours - theirs, theirs) < 1e-12


def _reader(program: TTTProgram, state: torch.fx.Node, up, query: torch.fx.Node,
            query_rows: bool, tokens: int | None = None) -> torch.fx.Node | None:
    """The first node reading ``state`` (and no other live state) that equals the query times
    the state as a column, ``q z``, laid out as the state's batch axes (a chunk loop's:
    then its ``tokens`` queries) then axes of size 1 — through which alone the loop's output
    reads the state (a dot product's flattened heads, ``[B·H, 1]``, are passed over for the
    view that restores them)."""
    mine = descendants(program.body.graph, [state]) | ancestors(state) | {state}
    others = up.state_dep - mine
    batch = tuple(state.meta["val"].shape[:-1]) + (() if tokens is None else (tokens,))
    for n in program.body.graph.nodes:
        if n.op != "call_function" or state not in ancestors(n) or n in others \
                or any(a in others for a in ancestors(n)) or not _batch_laid(n, batch):
            continue
        got = _evaluated(program, [*_boundary(program), state], [query, n, state])
        if got is None:
            continue
        q, read, z = got
        q = q if query_rows else q.transpose(-1, -2)
        rows = q.reshape(-1, q.shape[-2], q.shape[-1])
        if z.numel() != rows.shape[0] * rows.shape[-1] or read.numel() != rows.shape[:2].numel():
            continue
        expected = rows @ z.reshape(rows.shape[0], -1, 1)
        if relative_error(read.reshape(-1) - expected.reshape(-1), expected.reshape(-1)) < 1e-12:
            return n         # that the output reads the state through it alone: lift's cut
    return None


def _batch_laid(n: torch.fx.Node, batch: tuple) -> bool:
    """Whether ``n``'s value is laid out as ``batch`` then axes of size 1."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    shape = tuple(val.shape)
    return shape[:len(batch)] == batch and all(d == 1 for d in shape[len(batch):])


__all__ = ["Companion", "companions"]
