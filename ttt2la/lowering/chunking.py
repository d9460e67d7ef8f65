"""Cut a program's stream sources into per-chunk tensors and join chunk outputs back together.

A chunked stream of length ``L`` along its token axis is zero-padded to ``N·C`` (``N =
ceil(L/C)``) and given a leading chunk axis, so chunk ``j`` is ``X[j]`` with ``C`` tokens at the
original axis; a per-token stream is the source with its token axis moved to the front
(``N = L``). Outputs go the other way: concatenated (stacked, per token) along
``OutputSpec.axis`` and cut back to ``L``.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import UnsupportedTTTError
from ..ir import OutputSpec, StreamSpec, TTTProgram, inverse_order


@dataclass(frozen=True)
class ChunkLayout:
    """How a sequence of length ``length`` splits: ``n_chunks`` chunks, ``tail`` real tokens in
    the last one (``chunk_size`` when it is full; always 1 for per-token loops)."""

    length: int
    chunk_size: int
    n_chunks: int
    per_token: bool

    @property
    def tail(self) -> int:
        """Real tokens in the last chunk."""
        if self.per_token:
            return 1
        return self.length - (self.n_chunks - 1) * self.chunk_size

    @property
    def partial(self) -> bool:
        """Whether the last chunk is padded."""
        return not self.per_token and self.tail != self.chunk_size


def stream_length(program: TTTProgram, invariants: list[torch.Tensor]) -> int:
    """``L``: the common length of every stream source along its token axis."""
    if not program.streams:
        raise UnsupportedTTTError(
            "This loop reads no chunk streams, so the number of chunks cannot be derived from "
            "the inputs; the recognizer must describe at least one stream.")
    lengths = {}
    for spec in program.streams:
        src = invariants[spec.source]
        lengths[spec.name] = int(src.shape[spec.axis % src.dim()])   # concrete, also in a trace
    if len(set(lengths.values())) != 1:
        where = f"{program.module_path or 'the model'} ({program.loop_src})" \
            if program.loop_src else "this loop"
        raise UnsupportedTTTError(
            f"The sequences the loop of {where} slices its chunks from have different lengths "
            f"at this input ({', '.join(f'{k}: {v}' for k, v in lengths.items())}, named after "
            "the loop's values); every stream must be sliced from a sequence of the same length. "
            "Where the code handles a remainder of the sequence apart from its whole chunks, "
            f"convert from example inputs whose length is a multiple of the chunk size "
            f"({program.chunk_size}).")
    length = next(iter(lengths.values()))
    if length < 1:
        raise UnsupportedTTTError("The sequence is empty (length 0); there is nothing to run.")
    return length


def chunk_layout(program: TTTProgram, invariants: list[torch.Tensor]) -> ChunkLayout:
    """The chunk count and tail for the given invariants (the stream sources among them)."""
    length = stream_length(program, invariants)
    per_token = any(s.per_token for s in program.streams)
    c = program.chunk_size
    if per_token and c != 1 and not all(s.per_token for s in program.streams):
        # (slices of one token, ``x[t:t+1]``, beside tokens read as ``x[t]`` are one kind)
        tokens = [s.name for s in program.streams if s.per_token]
        chunks = [s.name for s in program.streams if not s.per_token]
        raise UnsupportedTTTError(
            f"The loop of {program.module_path or 'the model'} ({program.loop_src}) reads "
            f"some sequences one token at a time ({', '.join(tokens)}) and others in chunks "
            f"of {c} ({', '.join(chunks)}); every sequence a loop reads must advance alike. "
            "Read each as the loop's other sequences are read.")
    n = length if per_token else -(-length // c)
    return ChunkLayout(length, c, n, per_token)


def chunk_stream(source: torch.Tensor, spec: StreamSpec, layout: ChunkLayout) -> torch.Tensor:
    """``[N, *chunk shape]``: the stream's chunks stacked on a new leading axis."""
    axis = spec.axis % source.dim()
    if spec.per_token:
        return source.movedim(axis, 0)
    n, c = layout.n_chunks, layout.chunk_size
    if n * c == source.shape[axis]:
        return source.unflatten(axis, (n, c)).movedim(axis, 0)          # a view, no copy
    return _padded_chunks(source, axis, layout)


def _padded_chunks(source: torch.Tensor, axis: int, layout: ChunkLayout) -> torch.Tensor:
    """``[N, *chunk shape]`` of a sequence whose last chunk is partial, in one pass over it.

    Padding the whole sequence and then laying its chunks out moves it twice (``pad``, then
    the executors' ``contiguous``); here only the tail is padded and one ``cat`` writes the
    full chunks and the padded tail into a contiguous chunk-major tensor.
    """
    n, c, tail = layout.n_chunks, layout.chunk_size, layout.tail
    full = (n - 1) * c
    pad = [0, 0] * (source.dim() - 1 - axis) + [0, c - tail]
    last = F.pad(source.narrow(axis, full, tail), pad).unsqueeze(0)
    if n == 1:
        return last
    head = source.narrow(axis, 0, full).unflatten(axis, (n - 1, c)).movedim(axis, 0)
    return torch.cat([head, last])


def chunk_streams(program: TTTProgram, invariants: list[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], ChunkLayout]:
    """Every stream of ``program`` as ``[N, *chunk shape]``, with the layout it was cut by."""
    layout = chunk_layout(program, invariants)
    return [chunk_stream(invariants[s.source], s, layout) for s in program.streams], layout


def assemble_output(chunks: torch.Tensor | Sequence[torch.Tensor], spec: OutputSpec,
                    layout: ChunkLayout) -> torch.Tensor:
    """Join ``[N, *chunk output]`` along ``spec.axis`` and cut the padding back to ``L``. A list
    of the ``N`` chunk outputs (a loop's) is joined in one copy, with no stacked tensor first,
    laid out in ``spec.memory_order`` where it can be (``_joined_in_order``)."""
    if spec.per_token:                  # one token per iteration, stacked on a new axis
        if isinstance(chunks, torch.Tensor):
            return chunks.movedim(0, spec.axis % chunks.dim())
        return torch.stack(list(chunks), dim=spec.axis % (chunks[0].dim() + 1))
    if isinstance(chunks, torch.Tensor):
        axis = spec.axis % (chunks.dim() - 1)
        joined = chunks.movedim(0, axis).flatten(axis, axis + 1)
    else:
        axis = spec.axis % chunks[0].dim()
        joined = _joined_in_order(list(chunks), axis, spec.memory_order, layout)
    # a chunk's tokens are cut back to the length; items (one per chunk, a mini-batch-first
    # output) are the loop's own count, with no padding to cut
    return joined if spec.items else joined.narrow(axis, 0, layout.length)


def _joined_in_order(chunks: list[torch.Tensor], axis: int, order, layout: ChunkLayout
                     ) -> torch.Tensor:
    """The chunks joined along ``axis``, written straight into the memory order the code after
    the loop reads (``with_memory_order`` then copies nothing) where no gradient is recorded,
    nothing is cut and no compiler traces (it has its own layouts): one copy of the output, not
    two."""
    if not _joins_in_order(chunks, order, layout):
        return torch.cat(chunks, dim=axis)
    first = chunks[0]
    shape = list(first.shape)
    shape[axis] = sum(c.shape[axis] for c in chunks)
    out = torch.empty([shape[d] for d in order], dtype=first.dtype, device=first.device)
    return torch.cat(chunks, dim=axis, out=out.permute(inverse_order(order)))


def _joins_in_order(chunks: list[torch.Tensor], order, layout: ChunkLayout) -> bool:
    """Can the chunks be joined into ``order`` (another order than their own, one dtype, whole
    chunks, no gradient recorded, no compiler tracing)?"""
    first = chunks[0]
    if order is None or len(order) != first.dim() or list(order) == sorted(order):
        return False
    if layout.partial or any(c.dtype != first.dtype for c in chunks):
        return False
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(c.requires_grad for c in chunks))


def assemble_outputs(program: TTTProgram, chunk_outputs: list[torch.Tensor],
                     layout: ChunkLayout) -> list[torch.Tensor]:
    """Every chunk output of ``program`` joined over chunks (see ``assemble_output``): each a
    tensor with a leading chunk axis or a list of chunks."""
    return [assemble_output(y, spec, layout) for y, spec in zip(chunk_outputs, program.outputs)]


__all__ = ["ChunkLayout", "stream_length", "chunk_layout", "chunk_stream", "chunk_streams",
           "assemble_output", "assemble_outputs"]
