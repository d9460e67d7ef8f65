"""Feature maps that act token by token run once over the whole sequence, not chunk by chunk.

A lifted program's kernel features φ(Q), φ(K), its effective value and its output
post-processing are traced per chunk. When each of them maps every token on its own — a
projection, ``silu``, a per-token rate — running the traced graph once on the whole sequence
gives the same tensor as running it on every chunk and joining the results, without cutting the
streams into a chunk-major copy, laying that copy out for the runtime op and joining the
outputs back (three passes over every stream, measured as most of the gap to a hand-written
loop). Chunk-level values (a momentum coefficient that averages a chunk's gates, a per-chunk
scale) still run per chunk.

Whether a graph is token-local is decided by evaluating it, never assumed: in float64, on random
streams of two and of three chunks, the whole-sequence result must have the chunked results'
shape with exactly the expected token axis grown, and equal their concatenation to 1e-9. A mean
over the chunk's tokens, a causal mask inside the chunk, a size baked in for the chunk length or
a cumulative sum all fail it, and the program then runs chunk by chunk as before.
"""
from __future__ import annotations

import math

from typing import Sequence

import torch
import torch.fx

from ..analysis.op_vocabulary import RESHAPE_TARGETS
from ..ir import TTTProgram
from .precision import promoted

aten = torch.ops.aten

#: relative error under which the whole-sequence and the chunked float64 evaluations agree
AGREEMENT = 1e-9


def _random_like(node: torch.fx.Node, gen: torch.Generator, axis: int | None = None,
                 n: int = 1) -> torch.Tensor | None:
    """A random float64 tensor of ``node``'s traced shape, ``axis`` grown ``n``-fold."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    shape = list(val.shape)
    if axis is not None:
        shape[axis] *= n
    if val.is_floating_point():
        return torch.randn(shape, generator=gen, dtype=torch.float64)
    return torch.zeros(shape, dtype=val.dtype)


def _joined_axis(pieces: list[torch.Tensor], whole: torch.Tensor) -> int | None:
    """The one axis along which ``whole`` is the concatenation of ``pieces``, or None."""
    first = pieces[0]
    if first.dim() != whole.dim() or any(p.shape != first.shape for p in pieces):
        return None
    grown = [d for d in range(whole.dim()) if whole.shape[d] != first.shape[d]]
    if len(grown) != 1 or whole.shape[grown[0]] != len(pieces) * first.shape[grown[0]]:
        return None
    axis = grown[0]
    joined = torch.cat(pieces, dim=axis)
    scale = float(joined.norm()) or 1.0
    return axis if float((whole - joined).norm()) <= AGREEMENT * scale else None


def token_local(gm: torch.fx.GraphModule, inputs: Sequence[torch.fx.Node],
                token_axes: dict[torch.fx.Node, int], output_axes: Sequence[int],
                chunk_size: int) -> bool:
    """Whether ``gm`` (taking ``inputs``) run on whole sequences equals it run chunk by chunk.

    ``token_axes`` gives the token axis of every sequence input (as traced, ``chunk_size`` long);
    the other inputs are the same for every chunk. Output ``i`` must be joined along
    ``output_axes[i]`` (an axis of the traced output; negative counts from the end).
    """
    for node, axis in token_axes.items():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.shape[axis] != chunk_size:
            return False
    graph = promoted(gm)
    gen = torch.Generator().manual_seed(0)
    fixed = {n: _random_like(n, gen) for n in inputs if n not in token_axes}
    for n_chunks in (2, 3):
        whole = {n: _random_like(n, gen, a, n_chunks) for n, a in token_axes.items()}
        if any(v is None for v in (*whole.values(), *fixed.values())):
            return False

        def run(values):
            with torch.no_grad():
                return graph(*(values[n] for n in inputs))
        try:
            full = run({**fixed, **whole})
            pieces = [run({**fixed, **{n: x.narrow(token_axes[n], j * chunk_size, chunk_size)
                                       for n, x in whole.items()}})
                      for j in range(n_chunks)]
        except Exception:   # noqa: BLE001 - a size baked in for one chunk: not token-local
            return False
        for i, axis in enumerate(output_axes):
            got = _joined_axis([p[i] for p in pieces], full[i])
            if got is None or got != axis % full[i].dim():
                return False
    return True


def drop_identity_views(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove, in place, every ``expand``/``view``/``reshape`` that left its input's traced shape
    unchanged. Tracing ``@`` on batched operands writes such no-ops with the chunk's sizes baked
    in (``expand(x, [B, C, d])``); without them the graph runs at any length."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in RESHAPE_TARGETS:
            continue
        source = node.args[0]
        val, src = node.meta.get("val"), getattr(source, "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) \
                and tuple(val.shape) == tuple(src.shape):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _token_axis_after(node: torch.fx.Node, axis: int) -> int | None:
    """Where the token axis ``axis`` of ``node``'s first input lands in its output, for the
    moves of axes and reshapes that keep it whole; None where it is merged, split or lost."""
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return None                 # an op of several results (a layer norm's mean and rstd)
    src, out = src.shape, out.shape
    if node.target in (aten.clone.default, aten.alias.default, aten.contiguous.default):
        return axis
    if node.target is aten.unsqueeze.default:
        d = node.args[1] % len(out)
        return axis + (d <= axis)
    if node.target is aten.permute.default:
        return [p % len(src) for p in node.args[1]].index(axis)
    if node.target is aten.transpose.int:
        a, b = (d % len(src) for d in node.args[1:3])
        return b if axis == a else a if axis == b else axis
    if node.target is aten.reshape.default:
        before = math.prod(src[:axis])
        for j in range(len(out)):
            if math.prod(out[:j]) == before and out[j] == src[axis]:
                return j
    return None


def free_chunk_sizes(gm: torch.fx.GraphModule, token_axes: dict) -> torch.fx.GraphModule:
    """In place, every ``reshape`` that carries a token axis through whole (heads merged into
    the batch, ``[B·H, C, d]``, as ``torch.einsum`` traces it) infers that axis' length (``-1``)
    instead of naming the traced chunk's, so it reshapes sequences of any length. The token axes
    are followed from ``token_axes`` (input node → axis) through moves of axes and reshapes
    only; whether the graph is then token-local is ``token_local``'s to confirm."""
    axes = dict(token_axes)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args or node.args[0] not in axes:
            continue
        axis = _token_axis_after(node, axes[node.args[0]])
        if axis is None:
            continue
        axes[node] = axis
        if node.target is aten.reshape.default:
            sizes = list(node.args[1])
            if -1 not in sizes and all(isinstance(d, int) for d in sizes):
                sizes[axis] = -1
                node.args = (node.args[0], sizes, *node.args[2:])
    gm.recompile()
    return gm


def stream_axes(program: TTTProgram, nodes: Sequence[torch.fx.Node]) -> dict:
    """The token axis of every stream among ``nodes`` (a chunk keeps its source's rank)."""
    specs = dict(zip(program.stream_inputs(), program.streams))
    return {n: specs[n].axis % n.meta["val"].dim() for n in nodes if n in specs}


def per_token_rate(scales: Sequence[torch.Tensor], batch: int, chunk_size: int,
                   length: int) -> torch.Tensor | None:
    """The product of per-chunk scalars ``[N, ...]`` (``batch`` of them per chunk) as a rate per
    token ``[batch, length, 1]`` — the runtime op's ``lr`` — or None when there are none."""
    if not scales:
        return None
    rate = scales[0].reshape(-1, batch)
    for s in scales[1:]:
        rate = rate * s.reshape(-1, batch)
    return rate.transpose(0, 1).repeat_interleave(chunk_size, dim=1)[:, :length].unsqueeze(-1)


__all__ = ["token_local", "stream_axes", "per_token_rate", "drop_identity_views",
           "free_chunk_sizes", "AGREEMENT"]
