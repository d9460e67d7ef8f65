"""Memories written with the final state's keys ride as extra value columns of its op.

Linear attention with its normaliser keeps two memories, ``S' = S + kᵀv`` and ``z' = z + k``, and
reads both with the same query: ``o = (q S) / (q·z + ε)``. ``z`` is one more column of ``S`` whose
value is always 1: ``[S | z]' = [S | z] + kᵀ[v | 1]`` and ``q [S | z] = [q S | q·z]``. So a state
beside the final one is a *companion* when, per token,

* its update is ``z' = γ z + c·k``: the final state's decay ``γ`` (the same polynomial), a
  constant ``c``, and the final state's key feature ``k`` itself (confirmed on random inputs);
* the loop reads it only through ``q·z`` with the final state's query (confirmed the same way).

The op then runs once on values widened by one column ``c`` per companion; each companion's read
and final state are its columns of the op's output and final state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..ir import TTTProgram, ancestors, descendants
from .affine_update import evaluate, factor_shape
from .executors import extract
from .precision import promoted, relative_error, samples


@dataclass(frozen=True)
class Companion:
    """A memory riding as a value column: its state's index, the column's constant value and
    the node that reads it (``q·z``, in the loop's own layout: the state's batch axes, then
    ``units`` axes of size 1)."""

    index: int
    column: float
    read: torch.fx.Node
    units: int = 1

    def read_shape(self, state: torch.Tensor) -> tuple:
        """The read's shape beside a state of the run's batch size."""
        return (*state.shape[:-1], *(1,) * self.units)


def companions(program: TTTProgram, others: list, up, key: torch.fx.Node,
               query: torch.fx.Node, query_rows: bool, accumulated) -> list[Companion] | None:
    """A ``Companion`` for each state of ``others`` (indices), or ``None`` when one is not.

    ``up`` is the final state's update (its decay ``gamma``, ``state_dep``), ``key`` / ``query``
    the nodes of its key feature and of its query (``query_rows``: tokens along the query's
    rows, as the op's ``φ(Q)`` takes them, else along its columns), ``accumulated`` lift's
    reading of a state's update as ``(γ, s, term)``.
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
        if len(step) != 1 or step[0][1] or not _same_values(program, term, key) \
                or not _same_decay(program, up, gamma, ins[i], not query_rows):
            return None
        state = outs[i] if program.order == "inclusive" else ins[i]
        reader = _reader(program, state, up, query, query_rows)
        if reader is None:
            return None
        batch = tuple(state.meta["val"].shape[:-1])
        shape = tuple(reader.meta["val"].shape)
        if shape[:len(batch)] != batch or any(d != 1 for d in shape[len(batch):]):
            return None                 # the read is laid out unlike the state's batch
        found.append(Companion(i, step[0][0], reader, len(shape) - len(batch)))
    return found


def _boundary(program: TTTProgram) -> list:
    return [*program.stream_inputs(), *program.invariant_inputs()]


def _evaluated(program: TTTProgram, boundary: list, outputs: list) -> list | None:
    """``outputs`` computed in float64 from random values of what they need in ``boundary``."""
    try:
        gm, inputs = extract(program.body, boundary, outputs)
    except RuntimeError:
        return None
    args = samples(inputs, 1, seed=3)
    if args is None:
        return None
    try:
        with torch.no_grad():
            return list(promoted(gm)(*(a[0] for a in args)))
    except Exception:
        return None


def _same_values(program: TTTProgram, term: torch.fx.Node, key: torch.fx.Node) -> bool:
    """Whether ``term`` holds the key feature's values, element for element."""
    got = _evaluated(program, _boundary(program), [term, key])
    if got is None or got[0].numel() != got[1].numel():
        return False
    return relative_error(got[0].reshape(-1) - got[1].reshape(-1), got[1].reshape(-1)) < 1e-12


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
            query_rows: bool) -> torch.fx.Node | None:
    """The first node reading ``state`` (and no other live state) that equals the query times
    the state as a column, ``q z`` — through which alone the loop's output reads the state."""
    mine = descendants(program.body.graph, [state]) | ancestors(state) | {state}
    others = up.state_dep - mine
    for n in program.body.graph.nodes:
        if n.op != "call_function" or state not in ancestors(n) or n in others \
                or any(a in others for a in ancestors(n)):
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


__all__ = ["Companion", "companions"]
