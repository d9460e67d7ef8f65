"""Build a ``TTTProgram`` directly from a Python function that *is* a loop body.

The recognizer produces programs from whole models; this builder is the short way in for
tests, for the runtime's own references and for users who want to analyse one body by hand::

    def body(W, k, v, q):
        W2 = W + k.transpose(-1, -2) @ v
        return (W2,), (q @ W2,)

    prog = program_from_body(body, states={"W": W0}, streams={"k": k0, "v": v0, "q": q0},
                             chunk_size=16, order="inclusive")

``streams`` are whole sequences (token axis at ``stream_axes[name]``, default 1): the body
sees one chunk of ``chunk_size`` tokens of each (one token, axis removed, with
``per_token=True``), and the sequences become invariants that the streams are sliced from.
``invariants`` are example loop-invariant tensors. The body returns
``(states_out_tuple, chunk_outputs_tuple)``.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ..ir import (KIND, NAME, InvariantSpec, OutputSpec, StateSpec, StreamSpec, TTTProgram)
from .capture import trace


def program_from_body(
    body: Callable,
    *,
    states: Mapping[str, torch.Tensor],
    streams: Mapping[str, torch.Tensor],
    invariants: Mapping[str, torch.Tensor] | None = None,
    chunk_size: int,
    stream_axes: Mapping[str, int] | None = None,
    output_axes: Sequence[int] | None = None,
    per_token: bool = False,
    order: str = "exclusive",
    last_chunk: str = "update",
    roles: Mapping[str, str] | None = None,
    stream_roles: Mapping[str, str] | None = None,
) -> TTTProgram:
    invariants = dict(invariants or {})
    stream_axes = dict(stream_axes or {})
    roles = dict(roles or {})
    stream_roles = dict(stream_roles or {})
    n_s, n_x = len(states), len(streams)

    def flat(*args):
        s, x, p = args[:n_s], args[n_s:n_s + n_x], args[n_s + n_x:n_s + n_x + len(invariants)]
        states_out, outs = body(*s, *x, *p)
        return tuple(states_out) + tuple(outs)

    def first_chunk(name, x):
        axis = stream_axes.get(name, 1)
        return x.select(axis, 0) if per_token else x.narrow(axis, 0, min(chunk_size, x.shape[axis]))

    sources = {f"{k}_seq": v for k, v in streams.items()}
    chunks = [first_chunk(k, v) for k, v in streams.items()]
    all_invariants = {**invariants, **sources}
    example = [*states.values(), *chunks, *all_invariants.values()]
    gm = trace(flat, *example)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = ["state"] * n_s + ["stream"] * n_x + ["invariant"] * len(all_invariants)
    names = [*states, *streams, *all_invariants]
    for ph, kind, name in zip(phs, kinds, names):
        ph.meta[KIND] = kind
        ph.meta[NAME] = name
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = out.args[0]
    out.args = (tuple(flat_out),)
    gm.recompile()

    inv_specs = [InvariantSpec(k, tuple(v.shape), v.dtype) for k, v in all_invariants.items()]
    stream_specs = []
    for i, name in enumerate(streams):
        stream_specs.append(StreamSpec(name, source=len(invariants) + i,
                                       axis=stream_axes.get(name, 1), per_token=per_token,
                                       role=stream_roles.get(name, name)))
    n_out = len(flat_out) - n_s
    output_axes = list(output_axes) if output_axes is not None else [1] * n_out
    return TTTProgram(
        body=gm,
        states=[StateSpec(k, tuple(v.shape), v.dtype, role=roles.get(k, "other"))
                for k, v in states.items()],
        streams=stream_specs,
        invariants=inv_specs,
        outputs=[OutputSpec(f"y{i}", axis=a, per_token=per_token)
                 for i, a in enumerate(output_axes)],
        chunk_size=chunk_size,
        order=order,
        last_chunk=last_chunk,
        function=getattr(body, "__name__", "body"),
    )


__all__ = ["program_from_body"]
