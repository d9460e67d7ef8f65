"""Find which submodules of a model run a Python loop, in one eager forward pass.

Every submodule's first inputs are captured with forward hooks, and a ``TorchFunctionMode``
notes, for every torch call, the innermost module running and the user frames of the call. A
module *holds a loop* when some call ran inside a ``for``/``while`` body of a function called
from that module's own ``forward`` (a parent looping over its children does not count). Chunk
slices seen inside the loop (``x[:, i:i+C]`` or ``x[:, t]``) give the chunk size, so that the
layer can then be traced at the smallest shape that shows a few iterations.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..ir import SourceLoc
from ..errors import ConversionError, UnsupportedTTTError, first_line
from .argument_writes import Structure
from .capture import _is_user_file, _no_compile, user_frame
from .cut_pieces import CutPieces
from .loops import LoopSite, _loops_in_file
from .prechunked import ChunkAxes
from .split_pieces import runs_a_generator


@dataclass
class LoopCandidate:
    """A submodule whose forward (or a helper it calls) runs a loop."""

    path: str
    module: torch.nn.Module
    loop: LoopSite
    args: tuple
    kwargs: dict
    chunk_sizes: set[int] = field(default_factory=set)
    slice_lengths: set[int] = field(default_factory=set)   # sequence length seen by the slices
    slice_starts: set[int] = field(default_factory=set)    # offsets of the chunk slices
    ops: int = 0
    probe_length: int | None = None     # the longer length the loop was found at, if any
    no_loop: bool = False               # no loop ran: a single test-time step, maybe
    #: ``(op, pieces, length)`` of every ``chunk(n)``/``tensor_split(n)`` the loop statement cuts
    fixed_cuts: list[tuple[str, int, int]] = field(default_factory=list)
    #: the other loops of the module's call that no op ran inside together with this one (in
    #: turn, neither inside the other): a second pass over the sequence, maybe, next to this
    apart: list["LoopCandidate"] = field(default_factory=list)
    #: every op run inside the loop only cut, laid out or described a tensor (``CUTTING``): it
    #: carries nothing along the sequence, and cuts it into pieces as a comprehension would
    cuts_only: bool = True
    #: the module the loop runs in, where the candidate is the module calling it with numbers
    #: of the length (``_to_callers``): what is converted where the caller cannot be
    callee: "LoopCandidate | None" = None
    #: what its forward changed among the objects it was called with (``argument_writes``)
    argument_writes: list[str] = field(default_factory=list)
    #: the ``(args, kwargs)`` of the model's later calls of the module in the example run (a
    #: block called twice, with another keyword the second time): ``InputLayout.other_calls``
    other_calls: list[tuple] = field(default_factory=list)


#: Names of the torch functions that only cut, lay out or describe a tensor: a loop that runs
#: nothing else (``qs.append(q[:, i:i + C])``) makes pieces of the sequence for another loop.
CUTTING = frozenset({
    "__getitem__", "narrow", "select", "split", "split_with_sizes", "chunk", "tensor_split",
    "unbind", "view", "reshape", "view_as", "reshape_as", "transpose", "permute", "movedim",
    "unsqueeze", "squeeze", "flatten", "unflatten", "contiguous", "size", "dim", "__len__",
    "__get__", "numel", "stride"})


def _user_frames(limit: int = 64) -> list[tuple[str, int, str]]:
    f = sys._getframe(2)
    out = []
    while f is not None and len(out) < limit:
        code = f.f_code
        if _is_user_file(code.co_filename):
            out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    out.reverse()
    return out


class _Recorder(TorchFunctionMode):
    def __init__(self, stack, sink, chunks: ChunkAxes, pieces: CutPieces, length: int | None):
        super().__init__()
        self.stack, self.sink, self.chunks, self.pieces = stack, sink, chunks, pieces
        self.length = length

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.stack:
            self.sink(self.stack[-1], func, args, kwargs or {}, _user_frames())
        out = func(*args, **(kwargs or {}))
        self.pieces.note(_cut_info(func, args, kwargs or {}, self.chunks), out)
        if args:
            self.pieces.note_slice(_slice_info(func, args, self.chunks, self.length), args[0],
                                   out)
        self.chunks.note(func, args, kwargs or {}, out)
        return out


def _forward_site(module: torch.nn.Module) -> tuple[str, str, int, int] | None:
    fwd = type(module).forward
    code = getattr(fwd, "__code__", None)
    if code is None:
        return None
    try:
        import inspect

        lines, start = inspect.getsourcelines(fwd)
    except (OSError, TypeError):
        return None
    return os.path.abspath(code.co_filename), code.co_name, start, start + len(lines)


def _narrowed(func, args):
    """``(size, length, offset)`` of ``x.narrow(dim, start, size)`` / ``x.select(dim, t)`` (as
    methods or ``torch.`` functions) with int arguments, else ``None``."""
    name = getattr(func, "__name__", "")
    if name not in ("narrow", "select") or len(args) < 3 or not isinstance(args[0], torch.Tensor) \
            or args[0].dim() == 0 or not all(isinstance(a, int) for a in args[1:]):
        return None
    x, dim, start = args[0], args[1] % args[0].dim(), args[2]
    size = args[3] if name == "narrow" and len(args) > 3 else 1
    return size, x.shape[dim], start % x.shape[dim]


def _slice_info(func, args, chunks: ChunkAxes | None = None, length: int | None = None):
    """Chunk size, sequence length and offset of ``x[..., a:b]`` / ``x[..., t]`` (or their
    ``narrow`` / ``select`` spellings) on a tensor, or of chunk ``i`` taken on the chunk axis of
    a pre-chunked ``[…, N, …, K, …]`` tensor (``x[i]``, ``x[:, i]``; ``prechunked``).

    An index that takes several axes (``q[:, h, s:e]``, a head and a chunk of a head-major
    tensor) is read on the axis of the example's sequence ``length`` where one has it, else on
    its first indexed axis."""
    chunked = chunks.indexed(func, args) if chunks is not None else None
    if chunked is not None:
        return chunked
    narrowed = _narrowed(func, args)
    if narrowed is not None:
        return narrowed
    if getattr(func, "__name__", "") != "__getitem__" or len(args) < 2:
        return None
    x, idx = args[0], args[1]
    if not isinstance(x, torch.Tensor):
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    dim = 0
    taken = []
    for item in idx:
        if item is Ellipsis:
            dim = x.dim() - (len(idx) - 1 - idx.index(Ellipsis)) - 1
        elif isinstance(item, slice):
            if isinstance(item.start, int) and isinstance(item.stop, int) and item.step in (None, 1):
                taken.append((item.stop - item.start, x.shape[dim], item.start))
        elif isinstance(item, int):
            taken.append((1, x.shape[dim], item))
        dim += 1
    on_sequence = [t for t in taken if t[1] == length]
    return (on_sequence or taken or [None])[0]


#: Cuts a loop statement may iterate: ``split(C)`` and ``unbind()`` hand out chunks of a fixed
#: size (``unbind``: one token); ``chunk(n)`` and ``tensor_split(n)`` a fixed number of pieces.
#: Each with the keyword names its size or count may be passed by.
_CUTS = {"split": ("split_size_or_sections", "split_size"), "unbind": (),
         "chunk": ("chunks",), "tensor_split": ("indices_or_sections", "sections")}
FIXED_COUNT_CUTS = ("chunk", "tensor_split")


def _cut_info(func, args, kwargs, chunks: ChunkAxes) -> tuple[str, int, int] | None:
    """``(op, size, length)`` of a cut such as ``x.split(C, dim)`` (``size`` the chunk size; 1
    for ``unbind``, ``K`` for the chunks of a pre-chunked ``x``) or ``x.chunk(n, dim)`` (``size``
    the number of pieces), ``length`` the size of the axis cut (in tokens): what a loop
    statement like ``for xc in x.split(C, 1)`` or ``for xc in x`` iterates over."""
    name = getattr(func, "__name__", "")        # ``for xc in x`` arrives as ``x.unbind(0)``
    if name not in _CUTS or not args or not isinstance(args[0], torch.Tensor) \
            or args[0].dim() == 0:
        return None
    x, rest = args[0], list(args[1:])
    if name == "unbind":
        size = 1
    else:
        size = rest.pop(0) if rest else next((kwargs[k] for k in _CUTS[name] if k in kwargs), None)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            return None
    dim = rest[0] if rest else kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return None
    chunked = chunks.cut(x, dim) if name == "unbind" else None
    if chunked is not None:
        return (name, *chunked)
    return name, size, x.shape[dim % x.dim()]


#: Longest sequence an example is stretched to when it is too short to show the loop.
MAX_PROBE_LENGTH = 1 << 12


def sequence_length(example_inputs: tuple) -> int | None:
    """The example's length: axis 1 of its first batch-first tensor input."""
    x = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return None if x is None else x.shape[1]


def stretch(example_inputs: tuple, length: int) -> tuple:
    """The example repeated along its sequence axis (axis 1) to ``length`` tokens."""
    L = sequence_length(example_inputs)

    def one(x):
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != L:
            return x
        reps = -(-length // x.shape[1])
        return torch.cat([x] * reps, dim=1).narrow(1, 0, length)
    return tuple(one(x) for x in example_inputs)


def discover(model: torch.nn.Module, example_inputs: tuple,
             example_kwargs: dict | None = None) -> list[LoopCandidate]:
    """Run ``model`` and return the submodules that hold a loop, outermost first.

    An example too short to run the loop at all (a layer that updates on every chunk but the
    last, fed one chunk) is stretched along its sequence axis, doubling its length, until some
    loop runs; the candidates keep the inputs of the example itself.
    """
    try:
        found, captured = _discover_once(model, example_inputs, example_kwargs)
    except ConversionError:
        raise
    except Exception as e:
        where = user_frame(e)
        raise UnsupportedTTTError(
            f"{type(model).__name__} failed on the example inputs"
            f"{f' at {where}' if where else ''} ({type(e).__name__}: "
            f"{first_line(e)}). ttt2la runs the model once on "
            "example_inputs, without gradients, to find its loops: pass inputs the model "
            "accepts (a tuple of positional arguments, example_kwargs for keyword ones), and "
            "wrap code that takes gradients inside forward in torch.enable_grad().") from e
    L = sequence_length(example_inputs)
    length = L
    while not found and L is not None and length < MAX_PROBE_LENGTH:
        length = max(2 * length, 2)
        try:
            found, _ = _discover_once(model, stretch(example_inputs, length), example_kwargs)
        except Exception:               # the model does not run at other lengths
            break
        for cand in found:
            cand.args, cand.kwargs = captured.get(cand.path, (cand.args, cand.kwargs))
            cand.probe_length = length
    if not found:
        found = _without_loop(model, captured)
    return found


def _without_loop(model: torch.nn.Module, captured: dict) -> list[LoopCandidate]:
    """The model itself as a candidate when no loop ran anywhere: its forward may step its
    fast weights once, in straight-line code (the single-step recognizer decides)."""
    site = _forward_site(model)
    if site is None or "" not in captured:
        return []
    file, name, lo, hi = site
    args, kwargs = captured[""]
    return [LoopCandidate("", model, LoopSite(file, name, lo, lo, hi), args, kwargs,
                          no_loop=True)]


def _discover_once(model, example_inputs, example_kwargs):
    """One eager forward: the loop candidates and every submodule's captured inputs."""
    paths = {m: p for p, m in model.named_modules()}
    hooks = _CapturedInputs(paths)
    sink = _LoopSink(paths, hooks.captured, sequence_length(example_inputs))
    with hooks, torch.no_grad(), _no_compile(), \
            _Recorder(hooks.stack, sink, sink.chunks, sink.pieces, sink.length):
        model(*example_inputs, **(example_kwargs or {}))
    sink.add_cuts()
    found = _to_callers(_busiest_loops(sink.found, sink.together), hooks.captured, paths,
                        sink.length)
    for cand in found:
        for c in (cand, cand.callee):
            if c is not None:
                c.argument_writes = hooks.writes.get(c.path, [])
                c.other_calls = hooks.later.get(c.path, [])
    return found, hooks.captured


def _to_callers(found: list[LoopCandidate], captured: dict, paths: dict,
                length: int | None) -> list[LoopCandidate]:
    """Each candidate whose call passes numbers of the sequence's length (LaCT's novel-view
    blocks hand their TTT layer a schedule, ``info["ops"]``, of token offsets computed from
    the length) taken as the module that called it: probed at other lengths, the layer would
    run the example's schedule, where the caller computes the schedule of each length. The
    nearest caller whose own inputs hold no such number and that runs no other loop; the
    candidate as it is where none does."""
    if length is None:
        return found
    modules = {p: m for m, p in paths.items()}
    out = []
    for cand in found:
        path = cand.path
        while path and _holds_the_length(captured.get(path), length):
            parent = path.rpartition(".")[0]
            if parent not in captured or any(c is not cand and within(c.path, parent)
                                             for c in found):
                path = cand.path
                break
            path = parent
        if path != cand.path and not _holds_the_length(captured[path], length):
            args, kwargs = captured[path]
            cand = dataclasses.replace(cand, path=path, module=modules[path], args=args,
                                       kwargs=kwargs, callee=cand)
        out.append(cand)
    return out


def _holds_the_length(call: tuple | None, length: int) -> bool:
    """Whether a module's captured call ``(args, kwargs)`` holds the number ``length`` among
    its non-tensor values (a schedule's offsets, a ``seq_len=`` argument)."""
    if call is None:
        return False
    return any(type(v) is int and v == length for v in pytree.tree_leaves(call))


def within(path: str, parent: str) -> bool:
    """Whether the module at ``path`` is the one at ``parent`` or inside it."""
    return parent == "" or path == parent or path.startswith(parent + ".")


#: how many calls of a module after its first one discovery keeps (``LoopCandidate.other_calls``)
_LATER_CALLS = 8


class _CapturedInputs:
    """Forward hooks on every module of ``paths`` while the context lasts: each module's first
    inputs (``captured``: ``path -> (args, kwargs)``), those of its later calls (``later``) and
    the paths of the modules running (``stack``, innermost last). A call made inside a
    ``torch.func`` transform (a memory model run under ``vmap(grad(…))``) is part of its
    caller's: its inputs are the transform's wrapped tensors, dead once it returns, so it
    records none, and the ops it runs are its caller's."""

    def __init__(self, paths: dict):
        self.paths = paths
        self.captured: dict[str, tuple] = {}
        self.later: dict[str, list[tuple]] = {}     # each module's other calls, in order
        self.stack: list[str] = []
        self.hooks: list = []
        self._before: dict[str, Structure] = {}    # each module's arguments at its first call
        self.writes: dict[str, list[str]] = {}      # what that call changed among them
        self._own: list[bool] = []          # per running call: is it its module's own

    def _pre(self, mod, args, kwargs):
        path = self.paths[mod]
        if self.stack and torch._C._functorch.peek_interpreter_stack() is not None:
            self.stack.append(self.stack[-1])
            self._own.append(False)
            return
        if path not in self.captured:
            self.captured[path] = (args, kwargs)
            self._before[path] = Structure(args, kwargs)
        elif len(self.later.setdefault(path, [])) < _LATER_CALLS:
            self.later[path].append((args, kwargs))
        self.stack.append(path)
        self._own.append(True)

    def _post(self, mod, args, kwargs, out):
        path = self.stack.pop()
        before = self._before.pop(path, None) if self._own.pop() else None
        if before is not None:
            self.writes[path] = before.changed(Structure(args, kwargs))

    def __enter__(self) -> "_CapturedInputs":
        for m in self.paths:
            self.hooks.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.hooks.append(m.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


class _LoopSink:
    """Called with every torch call made while a module runs (``_Recorder``): the loops of
    that module's forward (or the helpers it calls) the call ran inside become candidates,
    counting the call and the chunk slices it takes."""

    def __init__(self, paths: dict, captured: dict[str, tuple], length: int | None):
        self.forward_sites = {p: _forward_site(m) for m, p in paths.items()}
        self.by_path = {p: m for m, p in paths.items()}
        self.captured, self.length = captured, length
        self.found: dict[tuple[str, LoopSite], LoopCandidate] = {}
        self.chunks, self.pieces = ChunkAxes(), CutPieces()
        self.cuts: dict[tuple[str, LoopSite], list] = defaultdict(list)  # split/unbind in headers
        self.together: dict[tuple[str, LoopSite], set] = defaultdict(set)  # loops one op ran in

    def __call__(self, path, func, args, kwargs, frames) -> None:
        user = self._user_frames(path, frames)
        if user is None:
            return
        inside = []
        for at, inner in zip(user, user[1:] + [None]):
            # a generator the loop statement iterates runs once per iteration, as the body does
            lazily = inner is not None and runs_a_generator(inner)
            for loop in _loops_in_file(at.file):
                if loop.header_contains(at) and not lazily:
                    cut = _cut_info(func, args, kwargs, self.chunks)
                    if cut is not None:
                        self.cuts[(path, loop)].append(cut)
                if loop.contains(at) or (lazily and loop.header_contains(at)):
                    inside.append((path, loop))
                    self._count(path, loop, func, args)
        for key in inside:
            self.together[key].update(inside)

    def _user_frames(self, path, frames) -> list[SourceLoc] | None:
        """The frames from the module's own ``forward`` inwards (None: it is not on the stack)."""
        site = self.forward_sites.get(path)
        if site is None:
            return None
        file, name, lo, hi = site
        start = None
        for i, (f, line, fn) in enumerate(frames):
            if fn == name and lo <= line <= hi and os.path.abspath(f) == file:
                start = i
        if start is None:
            return None
        return [SourceLoc(f, line, fn) for f, line, fn in frames[start:]]

    def _count(self, path: str, loop: LoopSite, func, args) -> None:
        """One call ``func(*args)`` run inside ``loop`` of the module at ``path``."""
        key = (path, loop)
        self.pieces.read(key, args)
        cand = self.found.get(key)
        if cand is None:
            a, k = self.captured[path]
            cand = self.found[key] = LoopCandidate(path, self.by_path[path], loop, a, k)
        cand.ops += 1
        cand.cuts_only &= getattr(func, "__name__", "") in CUTTING
        info = _slice_info(func, args, self.chunks, self.length)
        if info is not None:
            cand.chunk_sizes.add(info[0])
            cand.slice_lengths.add(info[1])
            cand.slice_starts.add(info[2])

    def add_cuts(self) -> None:
        """Chunks cut before a loop, or by its header's ``split``/``chunk``, as its slices."""
        for key, cand in self.found.items():
            for size, length, start in self.pieces.chunks(key):   # a cut made before the loop
                cand.chunk_sizes.add(size)
                cand.slice_lengths.add(length)
                cand.slice_starts.add(start)
        for key, seen in self.cuts.items():
            if key not in self.found:
                continue
            cand = self.found[key]
            for op, size, length in seen:
                if op in FIXED_COUNT_CUTS:      # pieces that grow with the length: no chunk size
                    cand.fixed_cuts.append((op, size, length))
                    continue
                cand.chunk_sizes.add(size)
                cand.slice_lengths.add(length)
                cand.slice_starts.update(range(0, length, size))


def _busiest_loops(found: dict, together: dict) -> list[LoopCandidate]:
    """Per module, the loop that walks the longest stretch of the sequence (a loop over one
    chunk's positions, such as a UT transform solved row by row before the loop over chunks,
    walks a chunk), and among those the outermost (nested loops such as Newton–Schulz live
    inside it); the module's other loops no op ran inside with it are noted ``apart``."""
    per_module: dict[str, list[LoopCandidate]] = defaultdict(list)
    for cand in found.values():
        per_module[cand.path].append(cand)
    out = []
    for path, cands in per_module.items():
        cands.sort(key=lambda c: (c.cuts_only, -max(c.slice_lengths, default=0), -c.ops))
        near = together[(path, cands[0].loop)]
        cands[0].apart = [c for c in cands[1:] if (path, c.loop) not in near]
        out.append(cands[0])
    out.sort(key=lambda c: c.path.count("."))
    return out


__all__ = ["discover", "LoopCandidate", "MAX_PROBE_LENGTH", "sequence_length", "stretch",
           "within"]
