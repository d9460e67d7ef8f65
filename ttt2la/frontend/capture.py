"""Tracing user code to aten graphs with the Python frames of every op.

``trace(fn, *args)`` runs ``make_fx`` with compilation disabled (so functions decorated with
``torch.compile`` trace like plain Python) and records, on every node, the user frames that
produced it: ``node.meta[FRAMES]`` is a tuple of ``SourceLoc`` from outermost to innermost,
``node.meta[SRC]`` the innermost one. Frames from torch itself and from ttt2la are dropped.
The frames are what the loop recognizer uses to tell loop iterations apart.
"""
from __future__ import annotations

import contextlib
import functools
import linecache
import logging
import os
import re
import sys
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir import SRC, SourceLoc, lazy_graph_modules, quiet_deepcopy
from ..validation import needs_grad_mode
from .decompositions import DECOMPOSITIONS
from .output_types import recording, with_output_types
from .shape_values import shape_only_values
from .trace_guards import no_numpy
from .user_code import is_users

FRAMES = "ttt2la_frames"

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


@functools.lru_cache(maxsize=4096)
def _is_user_file(path: str) -> bool:
    if path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR + os.sep + "frontend"):
        return False
    if path.startswith("<") and "ttt2la" not in path:
        return path.startswith("<stdin>") or path.startswith("<string>")
    return "site-packages/torch" not in path and "/contextlib.py" not in path \
        and "/functools.py" not in path and "/typing.py" not in path


class _UserStack(list):
    """The user frames of a stack, each already as ``traceback`` formats it."""

    def format(self) -> list[str]:
        return self


@functools.lru_cache(maxsize=1 << 16)
def _frame_line(file: str, line: int, function: str) -> str:
    return f'  File "{file}", line {line}, in {function}\n'


class _UserFramesOnly:
    """Stands in for fx's ``CapturedTraceback`` while tracing: the user frames of the stack, read
    from the live frames without their source lines (``parse_frames`` reads those once per
    line). fx's own capture symbolizes and formats every frame, the caller's included (a test
    runner's fifty), for every node: most of a trace's time."""

    @staticmethod
    def extract() -> "_UserFramesOnly":
        return _UserFramesOnly()

    @staticmethod
    def summary() -> _UserStack:
        lines = []
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if _is_user_file(code.co_filename):
                lines.append(_frame_line(code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        lines.reverse()
        return _UserStack(lines)


@contextlib.contextmanager
def _all_user_frames():
    """Make fx keep every user frame in ``node.stack_trace`` (it keeps only ``forward`` ones),
    captured by ``_UserFramesOnly`` and kept as captured."""
    import torch.fx.proxy as fx_proxy

    original = fx_proxy.TracerBase._filter_traceback_frames, fx_proxy.CapturedTraceback
    fx_proxy.TracerBase._filter_traceback_frames = lambda self, summary: summary
    fx_proxy.CapturedTraceback = _UserFramesOnly
    try:
        yield
    finally:
        fx_proxy.TracerBase._filter_traceback_frames, fx_proxy.CapturedTraceback = original


@contextlib.contextmanager
def _no_compile():
    """Run ``torch.compile``-decorated code eagerly so that it traces like plain Python."""
    import torch._dynamo

    with torch.compiler.set_stance("force_eager"), \
            torch._dynamo.config.patch(error_on_nested_fx_trace=False):
        yield



def user_frame(e: BaseException) -> str | None:
    """``file:line (`code`)`` of the innermost user frame in an exception's traceback."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if is_users(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    code = (f.line or "").strip()
    return f"{f.filename}:{f.lineno}" + (f" (`{code}`)" if code else "")


def parse_frames(stack_trace: str | None) -> tuple[SourceLoc, ...]:
    if not stack_trace:
        return ()
    frames = []
    for m in _FRAME_RE.finditer(stack_trace):
        file, line, func = m.group("file"), int(m.group("line")), m.group("func")
        code = linecache.getline(file, line).strip()
        frames.append(SourceLoc(file, line, func, code))
    return tuple(frames)


def annotate_frames(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    cache: dict[str, tuple[SourceLoc, ...]] = {}
    for node in gm.graph.nodes:
        st = node.meta.get("stack_trace") or node.stack_trace
        if st not in cache:
            cache[st] = parse_frames(st)
        frames = cache[st]
        node.meta[FRAMES] = frames
        if frames:
            node.meta[SRC] = frames[-1]
    return gm


@contextlib.contextmanager
def quiet_fake_tensors():
    """Fake tensors log every failed shape check, with its traceback, at ERROR level; a trace
    at a probe shape the layer's code rejects is expected, and reported by the conversion."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


def trace(fn: Callable[..., Any], *args, tracing_mode: str = "fake") -> torch.fx.GraphModule:
    """``make_fx(fn)(*args)`` with user frames on every node and compilation disabled.

    The trace is functionalized (in-place writes such as ``out[:, i:i+C] = y`` become
    ``slice_scatter``, the ``copy`` in them read as the value written: ``slice_assignments``)
    and dead code is removed, so that every node is a pure, differentiable function of its
    inputs — what loop recognition, the passes and the executors all rely on. Code that takes
    gradients with ``torch.autograd.grad`` (after ``requires_grad_()``, or of weights that
    require grad, passed so in ``args``) cannot run inside the functionalization transform; it is
    traced plainly first, with autograd live, and that graph functionalized.
    A few fused ops are traced as their definitions (``decompositions``: ``lerp``, ``mse_loss``,
    and ``baddbmm``/``addmm`` inside loop bodies), the pieces of a ``split`` or ``unbind``
    that a loop statement cuts as the slices they are (``split_pieces``), products summed
    over an axis in a loop body as the matmuls they are (``summed_products``), and a matmul of
    one row by one column there as the dot product it is (``dot_products``). The output keeps
    the tuple types ``fn`` returned (a ``torch.Size``: ``output_types``).
    """
    specs: list = []        # what ``fn`` returns, whose tuple types fx's output node drops
    with quiet_fake_tensors():
        try:
            gm = _trace_functional(recording(fn, specs), _detached(args), tracing_mode)
        except RuntimeError as e:
            if "requires_grad_" not in str(e) and not needs_grad_mode(e):
                raise   # neither ``requires_grad_()`` nor ``autograd.grad`` in functionalization
            gm = _trace_then_functionalize(recording(fn, specs), args, tracing_mode)
    gm = with_output_types(gm, specs)
    from .dot_products import dot_products_as_sums
    from .slice_assignments import slice_assignments_as_values
    from .split_pieces import split_pieces_as_slices     # they import FRAMES from here
    from .summed_products import summed_products_as_matmuls

    gm = slice_assignments_as_values(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()

    return dot_products_as_sums(summed_products_as_matmuls(split_pieces_as_slices(annotate_frames(gm))))


def _detached(args):
    """``args`` with every tensor detached: the functional trace records no gradients."""
    return pytree.tree_map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, args)


def _trace_functional(fn, args, tracing_mode: str) -> torch.fx.GraphModule:
    pure = torch.func.functionalize(fn, remove="mutations")
    with _no_compile(), _all_user_frames(), shape_only_values(), no_numpy(), lazy_graph_modules():
        return make_fx(pure, DECOMPOSITIONS, tracing_mode=tracing_mode, record_stack_traces=True,
                       _allow_non_fake_inputs=True)(*args)


def _trace_then_functionalize(fn, args, tracing_mode: str) -> torch.fx.GraphModule:
    """Trace with autograd live (``requires_grad_`` and ``autograd.grad`` run as in eager, their
    backward recorded as aten ops), then functionalize that graph, keeping each node's frames."""
    from torch.fx import traceback as fx_traceback

    with _no_compile(), _all_user_frames(), torch.enable_grad(), shape_only_values(), no_numpy(), \
            lazy_graph_modules():
        plain = make_fx(fn, DECOMPOSITIONS, tracing_mode=tracing_mode, record_stack_traces=True,
                        _allow_non_fake_inputs=True)(*args)
    flat_args = pytree.tree_leaves(args)

    def replay(*flat):
        # flat in, flat out: the outputs as ``plain``'s output node lists them, which is what the
        # codegen copied below unflattens (an unflattened single tensor would be read as a list)
        return torch.fx.Interpreter(plain).run(*flat, enable_io_processing=False)

    pure = torch.func.functionalize(replay, remove="mutations")
    with fx_traceback.preserve_node_meta(), lazy_graph_modules():
        gm = make_fx(pure, tracing_mode=tracing_mode, _allow_non_fake_inputs=True)(*flat_args)
    gm.graph._codegen = quiet_deepcopy(plain.graph._codegen)
    gm.recompile()
    return gm


__all__ = ["trace", "FRAMES", "parse_frames", "annotate_frames", "user_frame"]
