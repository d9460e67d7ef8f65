"""Recognize the TTT inner loop of one layer: trace it small, roll the loop up, generalize shapes.

``recognize_layer`` traces the layer with ``make_fx`` at three small shapes chosen from the
chunk size (``L0 = 3C + r`` shows three loop iterations, enough to tell carried state from
chunk streams), rolls the loop up at each, and fits the size arguments of the outer graph and
of the body as functions of batch size and length (``shapes.fit_template``).

Not every layer runs at every probe shape: one that tiles per-head weights over a batch with
the heads folded in takes only multiples of its head count, another only the batch size it was
written for. When a probe trace fails, the shapes are derived from the example instead
(``probe_plans``): batches in units of a divisor of the example's batch, lengths that keep its
chunk remainder, and as a last resort the example's batch alone. The converted layer then
accepts exactly the batch sizes its traces cover, and says so when called at another.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.func import functional_call

from ..as_found import traced_as_found
from ..attribute_guard import OWN_PREFIXES
from ..errors import (ConversionError, SideEffectError, UnsupportedShapeError, UnsupportedTTTError,
                      first_line)
from ..ir import TTTProgram, params_and_buffers
from ..filled_caches import settle_start
from .argument_writes import refusal as argument_refusal
from ..side_effects import assignment_site, refusal as side_effect_refusal
from ..submodule_hooks import hooks_described, refusal as hooks_refusal
from .call_signature import CallSignature
from .capture import _no_compile, user_frame
from .discover import MAX_PROBE_LENGTH, LoopCandidate, _discover_once
from .loops import find_loops
from .prechunked import unchunk_streams
from .remade_views import hoist_remade_views
from .trace_guards import data_dependent_message, data_dependent_node
from .rollup import (LengthDependent, RolledLoop, TooFewIterations, WholeChunksOnly,
                     refuse_loop_around, roll_up)
from .dataclass_nodes import carry_dataclasses
from .shape_constants import BatchConstant, refuse_shape_constants
from .chunk_counts import ChunkCountCheck
from .length_values import describe, length_values
from .shapes import GraphTemplate, fit_template
from .trace_cache import LayerTraces
from .sliced_length import sliced_length

B0, B1 = 2, 3


@dataclass
class InputLayout:
    """Which layer inputs carry the batch and the sequence, so any (B, L) can be read off.

    Sizes are fitted in units of ``batch_unit`` (``sizes`` returns ``(B // unit, L)``): a layer
    traced at multiples of ``unit`` runs at multiples of it, and with ``fixed_batch`` only at
    ``unit`` itself; other batch sizes raise ``UnsupportedShapeError``. A layer whose loop covers
    whole chunks only (``L // C``) runs at lengths that are multiples of ``length_unit``.
    """

    batch_axis: dict[int, int]          # flat input index -> batch axis
    token_axis: dict[int, int]          # flat input index -> token axis
    ref: int                            # flat input index to read B and L from
    batch_unit: int = 1
    fixed_batch: bool = False
    length_unit: int = 1
    loop_src: str = ""                  # the loop, named when a length is refused
    path: str = ""
    why: str = ""                       # the probe failure that restricted the batch sizes
    signature: CallSignature | None = None      # the example call, checked on every call
    traced_rest: tuple[int, int] | None = None  # (C, r): traced only at lengths L % C == r
    rest_why: str = ""                  # the probe failure that restricted the lengths
    rest_own: bool = True               # whether the layer's own code failed there
    batch_constant: str = ""            # a number of the batch size the traced code holds
    #: the layouts of the example run's later calls of the layer that are made otherwise than
    #: the call it was converted from (another keyword, a tensor passed where it was left out)
    other_calls: tuple["InputLayout", ...] = ()

    def length_of(self, x: torch.Tensor) -> int:
        """The number of tokens of ``x``, the reference input of a call."""
        return x.shape[self.token_axis[self.ref]]

    def untraced_length(self, L: int) -> str:
        """Why length ``L`` is not one the layer was traced at, or ``""``: a layer that failed
        at the usual probe lengths was traced at lengths with its example's remainder modulo the
        chunk only, so the converted graphs hold no other. The reason says whose the failure
        was: the layer's own code's, or the conversion's where that code runs there."""
        if self.traced_rest is None:
            return ""
        C, r = self.traced_rest
        if L % C == r:
            return ""
        whose = "its own code failed at the others" if self.rest_own else \
            "the conversion could not trace the others, where its code runs"
        return (f"length {L} leaves {L % C} token(s) after the last whole chunk of {C}, where the "
                f"layer was traced at lengths leaving {r} only: {whose} ({self.rest_why})")

    def untraced_batch(self, flat_inputs: list) -> str:
        """Why the call's batch size is not one the traces cover — not the one a number of the
        traced code was derived from (``shape_constants``), or not one the probes that traced
        could take — or ``""``."""
        x = flat_inputs[self.ref]
        B, unit = x.shape[self.batch_axis[self.ref]], self.batch_unit
        if self.batch_constant:
            return "" if B == unit else \
                f"batch size {B}, where the layer was traced at batch size {unit} only: " \
                f"{self.batch_constant}"
        accepted = self._accepted(B)
        if accepted:
            return f"batch size {B}, where the layer was traced at {accepted}: {self.why}"
        return ""

    def _accepted(self, B: int) -> str:
        """The batch sizes the probes that traced could take, where ``B`` is not one of them
        (``""`` where it is)."""
        if self.fixed_batch and B != self.batch_unit:
            return f"batch size {self.batch_unit} only"
        return f"batch sizes that are multiples of {self.batch_unit}" if B % self.batch_unit \
            else ""

    def other_values(self, flat_inputs: list) -> str:
        """The call's plain Python argument whose value is not the example's, described
        (``CallSignature.other_values``), or ``""``."""
        return "" if self.signature is None else self.signature.other_values(flat_inputs)

    def spelled(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call ``(args, kwargs)`` spelled as the example was, its arguments matched to the
        forward's parameters by name (``CallSignature.spelled``), so that its flattened inputs
        are in the order the converted graphs take them."""
        if self.signature is None:
            return args, kwargs
        return self.signature.spelled(args, kwargs, self.batch_axis, self.token_axis, self.path)

    def takes(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call ``(args, kwargs)`` is made as the example call was: spelled and
        built alike, every input of its rank, sizes and values (``CallSignature.check``)."""
        try:
            args, kwargs = self.spelled(args, kwargs)
            if self.signature is not None:
                self.signature.check(pytree.tree_leaves((tuple(args), dict(kwargs))),
                                     self.batch_axis, self.token_axis, self.ref, self.path)
        except UnsupportedShapeError:
            return False
        return True

    def other_example_call(self, args: tuple, kwargs: dict) -> int:
        """Which of the example run's later calls of the layer ``(args, kwargs)`` is made like
        (2 for the second call), where it is not made like the call the layer was converted
        from; 0 otherwise. Asked only of a layer the example run called otherwise again."""
        if not self.other_calls or self.takes(args, kwargs):
            return 0
        return next((n for n, other in enumerate(self.other_calls, 2)
                     if other.takes(args, kwargs)), 0)

    def sizes(self, flat_inputs: list) -> tuple[int, int]:
        if self.signature is not None:
            self.signature.check(flat_inputs, self.batch_axis, self.token_axis, self.ref,
                                 self.path)
        x = flat_inputs[self.ref]
        B, L = x.shape[self.batch_axis[self.ref]], self.length_of(x)
        unit = self.batch_unit
        if self.batch_constant and B != unit:
            raise UnsupportedShapeError(
                f"the converted {self.path or 'model'} was called at batch size {B}, but it was "
                f"converted for batch size {unit} only: {self.batch_constant}. Convert it again "
                "with example inputs of the batch size you call it with, or compute that number "
                "as a tensor from the input before the loop.")
        accepted = self._accepted(B)
        if accepted:
            raise UnsupportedShapeError(
                f"the converted {self.path or 'model'} was called at batch size {B}, but it was "
                f"converted for {accepted}: the layer's own code failed when traced at other "
                f"batch sizes ({self.why}). Convert it again with example inputs of the batch "
                "size you call it with.")
        if L % self.length_unit:
            raise UnsupportedShapeError(
                f"the converted {self.path or 'model'} was called at length {L}, but its loop "
                f"({self.loop_src}) runs over whole chunks of {self.length_unit} tokens only "
                f"and would leave the last {L % self.length_unit} out: call it at lengths that "
                f"are multiples of {self.length_unit} (pad the sequence), or loop over every "
                "token in the layer's code.")
        return B // unit, L


@dataclass
class RecognizedLayer:
    """What ``recognize_layer`` learned about one layer."""

    path: str
    candidate: LoopCandidate
    rolled: RolledLoop                  # at (B0, L0)
    rolled_L: RolledLoop                # at (B0, L1)
    rolled_B: RolledLoop                # at (B1, L0)
    layout: InputLayout
    in_spec: Any
    outer: GraphTemplate
    L0: int
    L1: int
    B0: int = B0                        # probe batch sizes, in units of layout.batch_unit
    B1: int = B1
    notes: list[str] = dataclasses.field(default_factory=list)
    caches: tuple[str, ...] = ()        # attributes its forward fills (``filled_caches``)

    @property
    def program(self) -> TTTProgram:
        return self.rolled.program


def _resize(x: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    reps = -(-n // x.shape[axis])
    if reps > 1:
        x = torch.cat([x] * reps, dim=axis)
    return x.narrow(axis, 0, n).contiguous()


def _layout(flat: list, seq_len: int | None, batch: int) -> InputLayout:
    batch_axis, token_axis = {}, {}
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            continue
        if x.shape[0] == batch:
            batch_axis[i] = 0
        if seq_len is not None:
            for ax in range(1, x.dim()):
                if x.shape[ax] == seq_len:
                    token_axis[i] = ax
                    break
    refs = [i for i in token_axis if i in batch_axis]
    if not refs and seq_len is None:
        raise UnsupportedTTTError(
            "could not tell which axis of the layer's input is the sequence: no length of the "
            "sequence is known for it (a module called on chunks, or on its weights, is no TTT "
            "layer of its own). Pass example inputs with the sequence on their second axis.")
    if not refs:
        raise UnsupportedTTTError(
            "could not tell which axis of the layer's input is the sequence: no input has an "
            f"axis of length {seq_len} after a batch axis of size {batch}. Pass example inputs "
            "whose sequence length differs from every feature size.")
    return InputLayout(batch_axis, token_axis, refs[0])


def other_calls(cand: LoopCandidate, layout: InputLayout, seq_len: int | None
                ) -> tuple[InputLayout, ...]:
    """The layouts of the example run's later calls of ``cand``'s layer that ``layout`` (its
    first call's) does not take: each with its own signature, sequence and batch axes. A call
    whose layout cannot be told is left out (it is refused as any unlike call is)."""
    found: list[InputLayout] = []
    for args, kwargs in cand.other_calls:
        if layout.takes(args, kwargs) or any(o.takes(args, kwargs) for o in found):
            continue        # made like the first call, or like a later one already kept
        flat = pytree.tree_leaves((tuple(args), dict(kwargs)))
        tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 1]
        if not tensors:
            continue
        length = seq_len if seq_len is not None and any(seq_len in x.shape[1:]
                                                        for x in tensors) \
            else tensors[0].shape[1]
        try:
            other = _layout(flat, length, tensors[0].shape[0])
        except ConversionError:
            continue
        other.signature = CallSignature.of(args, kwargs, cand.module)
        other.path = layout.path
        found.append(other)
    return tuple(found)


def _inputs_at(flat: list, layout: InputLayout, B: int, L: int) -> list:
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            if i in layout.batch_axis:
                x = _resize(x, layout.batch_axis[i], B)
            if i in layout.token_axis:
                x = _resize(x, layout.token_axis[i], L)
        out.append(x)
    return out


class _Forward(torch.nn.Module):
    """Runs ``layer.forward`` (or ``forward(layer, ...)``: a converted layer's code as written)
    without the layer's own hooks: a converted layer's hooks run around its converted forward,
    so a trace that ran them too would run them twice."""

    def __init__(self, layer: torch.nn.Module, forward: Callable | None = None):
        super().__init__()
        self.layer, self._forward = layer, forward

    def forward(self, *args, **kwargs):
        if self._forward is not None:
            return self._forward(self.layer, *args, **kwargs)
        return self.layer.forward(*args, **kwargs)


def traced_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers as a trace takes them: detached, each still requiring
    grad where it does, for code that takes ``torch.autograd.grad`` of a weight (``capture``)."""
    return {k: v.detach().requires_grad_(v.requires_grad)
            for k, v in params_and_buffers(module).items()}


def layer_function(module: torch.nn.Module, in_spec,
                   forward: Callable | None = None) -> Callable:
    """``f(params_and_buffers, *flat_inputs)`` calling the module's forward (or ``forward``,
    unbound) functionally."""
    wrapped = _Forward(module, forward)
    names = _weight_names(module)

    def f(pb, *flat):
        args, kwargs = pytree.tree_unflatten(list(flat), in_spec)
        with traced_as_found(module):
            return functional_call(wrapped, {f"layer.{n}": pb[k] for n, k in names.items()
                                             if k in pb}, args, kwargs, tie_weights=False)
    return f


def _weight_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name a weight of ``module`` is set through, once per owning module and attribute,
    to the name ``params_and_buffers`` gives it: a weight two modules tie is set through both,
    and a module held twice (``ModuleList([t, t])``) once — torch's own tying names it twice,
    and its restore then leaves the second name's traced tensor in the module."""
    canonical = {id(t): n for n, t in params_and_buffers(module).items()}
    names, seen = {}, set()
    for prefix, m in module.named_modules(remove_duplicate=False):
        for attr, t in (*m._parameters.items(), *m._buffers.items()):
            if t is None or (id(m), attr) in seen or id(t) not in canonical:
                continue
            seen.add((id(m), attr))
            names[f"{prefix}.{attr}" if prefix else attr] = canonical[id(t)]
    return names


def _roll_at(cand: LoopCandidate, fn: LayerTraces, flat: list, layout, B, L) -> RolledLoop:
    inputs = _inputs_at(flat, layout, B, L)
    pb = traced_weights(cand.module)
    try:
        gm = fn.trace(pb, *inputs)
    except ConversionError:
        raise
    except Exception as e:
        raise _trace_failure(cand, e, B, L) from e
    read = data_dependent_node(gm)
    if read is not None:
        raise UnsupportedTTTError(data_dependent_message(read, _layer_name(cand)))
    loops = [ld for ld in find_loops(gm) if ld[0] == cand.loop]
    if loops:
        refuse_loop_around(gm, cand.loop, L)
        hoist_remade_views(gm, cand.loop)           # views of a tensor written in place
    if loops and unchunk_streams(gm, cand.loop):        # scan style: x[i] of [N, ..., K, ...]
        loops = [ld for ld in find_loops(gm) if ld[0] == cand.loop]
    if not loops:
        raise _ShapeDependent(
            f"the loop at {cand.loop.src} did not run when {cand.path or 'the model'} was traced "
            f"at batch {B}, length {L}")
    try:
        return roll_up(gm, *loops[0], module_path=cand.path)
    except ConversionError:
        raise
    except Exception as e:
        err = UnsupportedTTTError(
            f"{_layer_name(cand)}: ttt2la could not roll up the loop at {cand.loop.src} "
            f"({_first_line(e)}). The loop's iterations could not be matched to one body; "
            "write it as a loop over chunks that carries the fast weights, or report the layer's "
            "code.")
        raise err from e


def _layer_name(cand: LoopCandidate) -> str:
    """``"blocks.0.attn (LaCTLayer)"`` — how errors name a layer."""
    cls = type(cand.module).__name__
    return f"{cand.path} ({cls})" if cand.path else cls


_DATA_DEPENDENT = ("DataDependent", "data-dependent", "data dependent", "item()", "tolist",
                   "Proxy object cannot be iterated", "symbolically traced variables")


def _trace_failure(cand: LoopCandidate, e: Exception, B: int, L: int) -> UnsupportedTTTError:
    """A failure of the user's code under ``make_fx``: where, and what to change."""
    where = user_frame(e)
    at = f" at {where}" if where else f" in the loop at {cand.loop.src}"
    text = f"{type(e).__name__}: {e}"
    if any(k in text for k in _DATA_DEPENDENT):
        what = ("the code reads a value out of a tensor (`.item()`, `.tolist()`, a Python `if` "
                "or `range` on a tensor), but ttt2la traces the layer with shapes only. Compute "
                "that value from sizes or Python numbers, or move it out of the layer's forward.")
    else:
        what = ("rewrite that line with torch operations that trace under make_fx (no NumPy, no "
                "in-place changes to parameters), or report it with the layer's code.")
    return UnsupportedTTTError(
        f"{_layer_name(cand)}: tracing failed{at} at batch {B}, length {L} "
        f"({_first_line(e)}): {what}")


class _ShapeDependent(UnsupportedTTTError):
    """A refusal that other probe shapes may not meet (the loop did not run, sizes did not fit)."""


def _run_at(cand: LoopCandidate, fn, flat: list, layout, B, L) -> None:
    """Run the layer eagerly at (B, L): far cheaper than a trace when the shape is rejected."""
    inputs = _inputs_at(flat, layout, B, L)
    pb = traced_weights(cand.module)
    with torch.no_grad(), _no_compile():
        fn(pb, *inputs)


_CACHE: "OrderedDict[tuple, RecognizedLayer]" = OrderedDict()
_CACHE_SIZE = 32


#: What every ``nn.Module`` keeps in its ``__dict__`` (parameter and hook tables, ``training``).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


class _Uncacheable(Exception):
    """A configuration value the signature cannot describe: the layer is traced every time."""


def _config_value(v):
    """A hashable description of one configuration value, containers included: a switch kept in
    a dict of operator options steers the code as much as one kept in its own attribute."""
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_config_value(x) for x in v))
    if isinstance(v, (set, frozenset)):
        return ("set", frozenset(_config_value(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_config_value(k), _config_value(x)) for k, x in v.items()))
    if callable(v) and not isinstance(v, torch.nn.Module):
        return v                                  # a function attribute steers the code too
    raise _Uncacheable(type(v).__name__)          # a tensor (its value is baked in), an object


def _layer_key(cand: LoopCandidate, in_spec) -> tuple | None:
    """What determines a layer's traces besides the shapes it is given: its code,
    configuration and weights' shapes, and the call's arguments by name (``in_spec``: one value
    passed as another keyword is another call).

    Parameters and buffers are graph inputs, so their values do not matter; plain Python
    attributes (chunk size, switches, containers of them) steer the code and are part of the
    key, as are the class attributes and globals the code reads and the methods it calls; what
    ttt2la itself keeps on a converted layer (its report, its state) steers nothing the layer's
    code does. A layer holding any other value — a tensor that is neither a parameter nor a
    buffer (its value is baked in), an object the key cannot describe — has no key: it is not
    cached.
    """
    attrs = []
    try:
        for name, m in cand.module.named_modules():
            for k, v in sorted(vars(m).items()):
                if k not in _MODULE_INTERNALS and not k.startswith(OWN_PREFIXES):
                    attrs.append((name, k, _config_value(v)))
            attrs.append((name, type(m)))
        outside = _read_from_outside(cand.module)
    except _Uncacheable:
        return None
    tensors = tuple((n, tuple(t.shape), t.dtype, str(t.device))
                    for n, t in params_and_buffers(cand.module).items())
    key = (type(cand.module), tuple(attrs), tensors, in_spec, outside)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _read_from_outside(module: torch.nn.Module) -> tuple:
    """The class attributes, globals and methods ``module``'s code reads from outside the layer
    (``GlobalGuard``), as they are now: they are baked into its traces as its attributes are."""
    from ..global_guard import GlobalGuard
    guard = GlobalGuard.of(module)
    if guard is None:
        return ()
    return tuple((what, _config_value(v)) for (_, what), v in zip(guard.entries, guard.values))


def _signature(layer_key: tuple | None, flat: list, seq_len, loop) -> tuple | None:
    """What determines a layer's recognition: its ``_layer_key``, the example's shapes and
    length, and the loop recognized."""
    if layer_key is None:
        return None
    inputs = tuple((tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor)
                   else ("value", repr(x)) for x in flat)
    return (layer_key, inputs, seq_len, loop)       # hashable, as ``layer_key`` is


def recognize_layer(cand: LoopCandidate, seq_len: int | None) -> RecognizedLayer:
    """Trace ``cand.module`` at three small shapes and return its program and outer template.

    Layers with the same code, configuration and shapes (the blocks of one model, the same
    layer converted at several levels) are traced once: the result is cached like a compile.
    """
    hooks = hooks_described(cand.module)
    if hooks:
        raise UnsupportedTTTError(hooks_refusal(_layer_name(cand), hooks))
    if cand.argument_writes:
        raise SideEffectError(argument_refusal(_layer_name(cand), cand.argument_writes),
                              attribute=cand.argument_writes[0])
    written, once, caches = settle_start(cand.module, (tuple(cand.args), dict(cand.kwargs)),
                                         _longer_call(cand, seq_len))
    if written:
        raise SideEffectError(side_effect_refusal(_layer_name(cand), cand.module, written, once),
                              attribute=written[0],
                              where=assignment_site(cand.module, written[0]) or None)
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    with traced_as_found(cand.module):      # the attributes its traces start from
        layer_key = _layer_key(cand, in_spec)
    key = _signature(layer_key, flat, seq_len, cand.loop)
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None:
        _CACHE.move_to_end(key)
        return _with_other_calls(dataclasses.replace(hit, path=cand.path, candidate=cand,
                                                      caches=caches), cand, seq_len)
    from .single_step import recognize_single_step
    if cand.no_loop:
        result = recognize_single_step(cand, seq_len, _no_loop(cand))
    else:
        seq_len = sliced_length(cand, flat, in_spec, seq_len)   # heads first: not axis 1
        refuse_second_loop(cand, seq_len)      # no single step either: refused as it is
        try:
            result = _recognize_layer(cand, seq_len, layer_key)
        except UnsupportedTTTError as refusal:      # no loop over the sequence: one step, maybe
            result = recognize_single_step(cand, seq_len, refusal)
    result = dataclasses.replace(result, caches=caches)
    if key is not None:
        _CACHE[key] = result
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return _with_other_calls(result, cand, seq_len)


def _with_other_calls(result: RecognizedLayer, cand: LoopCandidate,
                      seq_len: int | None) -> RecognizedLayer:
    """``result`` whose layout knows the example run's later calls of this very layer made
    otherwise than its first (kept out of the recognition cache: they are the instance's)."""
    layout = result.layout
    if not cand.other_calls or layout.signature is None:
        return result
    others = other_calls(cand, layout, seq_len)
    return dataclasses.replace(result, layout=dataclasses.replace(layout, other_calls=others)) \
        if others else result


def _no_loop(cand: LoopCandidate) -> UnsupportedTTTError:
    """The refusal of a layer that runs no loop and holds no single test-time step either."""
    return UnsupportedTTTError(
        f"{_layer_name(cand)} runs no Python loop, and its forward ({cand.loop.file}:"
        f"{cand.loop.line}) holds no single test-time step either (a weight computed from "
        "parameters, stepped once by an increment computed from the inputs, then read). ttt2la "
        "converts layers that loop over chunks or tokens carrying fast weights, or that step "
        "their fast weights once over all tokens.")


@dataclass(frozen=True)
class ProbePlan:
    """Where to trace a layer: batch sizes ``unit·B0`` and ``unit·B1`` (one batch, ``unit``, when
    ``fixed``), and lengths from the chunk size (``structured``: the example's chunk remainder)."""

    unit: int = 1
    fixed: bool = False
    structured: bool = False
    longer: bool = False             # one chunk more: four full chunks for ``L // C`` loops

    @property
    def batches(self) -> tuple[int, int]:
        """(B0, B1) in units of ``unit``; a fixed batch has no second size to fit against, so
        the batch trace is reused and no size is fitted as depending on the batch."""
        return (1, 2) if self.fixed else (B0, B1)

    def lengths(self, C: int, example_len: int | None) -> tuple[int, int]:
        extra = C if self.longer else 0
        if self.structured and example_len is not None:
            L0 = 3 * C + (example_len % C or C) + extra  # >= three updates, same remainder
            return L0, L0 + C
        r = C // 2 if C > 1 else 1
        return 3 * C + r + extra, 3 * C + r + 1 + extra

    def describe(self, C: int, example_len: int | None) -> str:
        L0, L1 = self.lengths(C, example_len)
        b0, b1 = self.batches
        batch = f"{self.unit}" if self.fixed else f"{self.unit * b0} and {self.unit * b1}"
        return f"batch {batch}, lengths {L0} and {L1}"


def probe_plans(example_batch: int, example_len: int | None) -> list[ProbePlan]:
    """The shapes to try, most general first: batches 2 and 3; then units that divide the
    example's batch (multiples of a head count, of the batch itself); then the example's batch
    alone — each with the usual lengths, then with lengths keeping the example's chunk remainder."""
    units = [1] + [d for d in range(2, example_batch + 1) if example_batch % d == 0]
    plans = [ProbePlan(u, False, st) for u in units for st in (False, True)]
    plans += [ProbePlan(example_batch, True, st) for st in (False, True)]
    return plans


def _layer_length(cand: LoopCandidate, tensors: list, seq_len: int | None) -> int | None:
    """The length of the layer's own sequence: the model's, when one of the layer's inputs has
    an axis of it, else the longest stretch the loop sliced that an input has."""
    if seq_len is None or not any(seq_len in x.shape[1:] for x in tensors):
        seq_len = next((n for n in sorted(cand.slice_lengths, reverse=True)
                        if any(n in x.shape[1:] for x in tensors)), None)
    return seq_len


def refuse_second_loop(cand: LoopCandidate, seq_len: int | None) -> None:
    """Refuse a layer whose call runs a second loop over the sequence beside ``cand.loop``.

    A converted layer runs one loop's plan; everything else in its call is traced once, at
    probe lengths, as straight-line code. A second loop apart from the first (neither inside
    the other) that walks the sequence is unrolled into that code at the iterations the probe
    lengths gave it: where those lengths took the same number of its chunks (all of them one
    chunk, when its chunks are longer than the first loop's probes), nothing else tells, and
    the conversion would run that number at every length. A loop apart that slices the
    sequence is run again eagerly at a longer length (twice the example's, or two of its
    slices more where those are longer): one that then runs more ops walks the sequence, and
    the layer is refused, naming both loops. One that runs as many (a loop over
    the first few tokens, over heads, over one chunk's positions) is code of a fixed size.
    """
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors or not cand.apart:
        return
    length = _layer_length(cand, tensors, seq_len)
    if length is None:
        return
    base = cand.probe_length or length
    sliced = [c for c in cand.apart if not c.cuts_only
              and (base in c.slice_lengths or length in c.slice_lengths)]
    if not sliced:
        return
    try:
        layout = _layout(flat, length, tensors[0].shape[0])
    except ConversionError:
        return
    # long enough for two more of the longest slices the loops apart took (chunks of 64 run
    # one chunk at 8 tokens and at 16), and at least twice the example
    chunk = max((n for c in sliced for n in c.chunk_sizes), default=1)
    longer = max(2 * base, min(base + 2 * chunk, MAX_PROBE_LENGTH))
    ops = {}
    for at in (base, longer):
        top = cand if at == length else None
        if top is None:
            args, kwargs = pytree.tree_unflatten(
                _inputs_at(flat, layout, tensors[0].shape[0], at), in_spec)
            try:
                found = _discover_once(cand.module, tuple(args), kwargs)[0]
            except Exception:       # the layer does not run at that length: the probes tell
                return
            top = next((c for c in found if c.path == ""), None)    # the layer itself
            if top is None:
                return
        ops[at] = {c.loop: c.ops for c in [top, *top.apart]}
    walking = [c for c in sliced
               if ops[longer].get(c.loop, 0) > ops[base].get(c.loop, c.ops)]
    if not walking:
        return
    loops = sorted([cand.loop, *(c.loop for c in walking)], key=lambda s: (s.file, s.line))
    named = ", ".join(f"the loop at {s.src}" for s in loops[:-1]) + \
        f" and the loop at {loops[-1].src}"
    raise UnsupportedTTTError(
        f"{len(loops)} loops over the sequence run one after the other in {_layer_name(cand)}, "
        f"in one call: {named}. ttt2la converts one loop over the sequence per module call; "
        "the converted layer would run the others at the fixed number of iterations it was "
        "traced with, wrong at other lengths. Put each loop in a submodule of its own (each is "
        "then converted on its own), or keep this layer as written (in a model, ttt2la leaves "
        "it unconverted and converts the other layers).")


def _longer_call(cand: LoopCandidate, seq_len: int | None) -> tuple[tuple, dict] | None:
    """The layer's example call at twice its length (``None`` where its length is unknown)."""
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    length = _layer_length(cand, tensors, seq_len) if tensors else None
    if not length:
        return None
    layout = _layout(flat, length, tensors[0].shape[0])
    if not layout.token_axis:
        return None
    args, kwargs = pytree.tree_unflatten(
        _inputs_at(flat, layout, tensors[0].shape[0], 2 * length), in_spec)
    return tuple(args), kwargs


def _recognize_layer(cand: LoopCandidate, seq_len: int | None,
                     layer_key: tuple | None) -> RecognizedLayer:
    carry_dataclasses((tuple(cand.args), dict(cand.kwargs)))    # ``Batch(x, mask)``: its fields
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise UnsupportedTTTError(f"{cand.path} takes no tensor input")
    batch = tensors[0].shape[0]
    seq_len = _layer_length(cand, tensors, seq_len)
    _refuse_fixed_cuts(cand, seq_len)
    layout = _layout(flat, seq_len, batch)
    layout.signature = CallSignature.of(cand.args, cand.kwargs, cand.module)
    sizes = {c for c in _chunk_sizes(cand, flat, layout, in_spec, batch, seq_len) if c > 0}
    C = max(sizes) if sizes else 1
    try:
        return _recognize_at_probes(cand, flat, layout, in_spec, batch, C, seq_len, layer_key)
    except UnsupportedTTTError as e:
        if cand.slice_starts:
            raise
        raise UnsupportedTTTError(_takes_no_chunks(cand)) from e


def _recognize_at_probes(cand, flat, layout, in_spec, batch: int, C: int, seq_len, layer_key):
    """The layer recognized at the first probe plan whose shapes its code takes."""
    fn = LayerTraces(layer_function(cand.module, in_spec), layer_key)
    failures: list[tuple[ProbePlan, Exception]] = []
    for plan in probe_plans(batch, seq_len):
        if not plan.fixed and any(isinstance(e, BatchConstant) for _, e in failures):
            continue                      # only the example's batch size holds its number
        try:
            return _recognize_at(cand, fn, flat, layout, in_spec, plan, C, seq_len, failures)
        except ConversionError as e:
            if not isinstance(e, (_ShapeDependent, LengthDependent, BatchConstant)):
                raise                     # what the loop does is unsupported at any shape
            failures.append((plan, e))
        except Exception as e:            # the layer's own code rejected these shapes
            failures.append((plan, e))
    raise _probe_failure(cand, failures, C, seq_len)


def _takes_no_chunks(cand: LoopCandidate) -> str:
    """Why a loop that took no piece of the sequence is no TTT loop (a loop over blocks)."""
    return (f"{_layer_name(cand)}: the loop at {cand.loop.src} takes no chunk or token of the "
            "sequence that ttt2la can read, so it carries nothing along it that ttt2la can see: "
            "a loop over blocks or over steps on the whole sequence, not over chunks. Any TTT "
            "layer it calls is converted on its own. (ttt2la reads the chunks a loop takes by "
            "slicing — x[:, s:e], narrow, select —, by split or unbind of the sequence in the "
            "loop statement, or, xs the sequence reshaped to [..., N, ..., K, ...] chunks, by "
            "xs[i] or xs[:, i] in the loop's body or by xs.unbind(axis of N), or xs itself, "
            "iterated in the loop statement; pieces or slices made before the loop when the "
            "body reads them one per iteration, in order; values a generator in the loop "
            "statement yields. Chunks read in another order, from the end say, are none of "
            "these: take each chunk inside the body, walking the sequence forward.)")


def _refuse_fixed_cuts(cand: LoopCandidate, seq_len: int | None) -> None:
    """A loop statement iterating ``x.chunk(n)`` or ``x.tensor_split(n)`` pieces of the sequence
    cuts a fixed number of pieces that grow with the length: no chunks of a fixed size."""
    for op, pieces, length in cand.fixed_cuts:
        if length == seq_len:
            raise UnsupportedTTTError(
                f"the loop at {cand.loop.src} iterates over the {pieces} pieces `{op}({pieces})` "
                f"cuts the sequence into: a fixed number of pieces, each longer as the sequence "
                f"grows, so its iterations are no chunks of a fixed size. Cut chunks of C tokens "
                f"with `.split(C, dim)` (or slice `x[:, s:s + C]`) instead.")


def _chunk_sizes(cand: LoopCandidate, flat: list, layout: InputLayout, in_spec, batch: int,
                 seq_len: int | None) -> set[int]:
    """The chunk slices' sizes, from an example long enough to show two chunks.

    An example no longer than one chunk shows a slice of its own length, not the chunk size:
    the layer is then run eagerly at doubling lengths until its loop slices two chunks. A loop
    that took no slice at all (a model's loop over its blocks, a step repeated on the whole
    sequence) will take none at any length, and is not run again.
    """
    if _shows_two_chunks(cand) or seq_len is None or not cand.slice_starts:
        return cand.chunk_sizes
    length = seq_len
    while length < MAX_PROBE_LENGTH:
        length = max(2 * length, 2)
        args, kwargs = pytree.tree_unflatten(_inputs_at(flat, layout, batch, length), in_spec)
        try:
            found = _discover_once(cand.module, tuple(args), kwargs)[0]
        except Exception:               # the layer does not run at this length
            break
        same = next((c for c in found if c.loop == cand.loop), None)
        if same is not None and _shows_two_chunks(same):
            return same.chunk_sizes
    return cand.chunk_sizes


def _shows_two_chunks(cand: LoopCandidate) -> bool:
    """Whether the loop sliced two chunks: two offsets from the sequence's start (a slice from
    its end, ``x[:, -1]``, is no second chunk)."""
    return len({s for s in cand.slice_starts if s >= 0}) >= 2


def _recognize_at(cand, fn, flat, layout, in_spec, plan: ProbePlan, C: int, seq_len,
                  failures) -> RecognizedLayer:
    """Trace at the three shapes of ``plan`` and fit the outer graph's sizes."""
    b0, b1 = plan.batches
    L0, L1 = plan.lengths(C, seq_len)
    for B, L in _probe_shapes(plan, C, seq_len):      # shapes the code rejects fail fast eagerly
        _run_at(cand, fn, flat, layout, plan.unit * B, L)
    try:
        rolled = _roll_at(cand, fn, flat, layout, plan.unit * b0, L0)
    except TooFewIterations:
        if plan.longer:
            raise
        # a loop over the whole chunks (``L // C``) ran three, the last without its dead update
        return _recognize_at(cand, fn, flat, layout, in_spec,
                             dataclasses.replace(plan, longer=True), C, seq_len, failures)
    if rolled.program.chunk_size != C:
        # the slices seen eagerly were not the chunk slices: retrace at the recognized size
        C = rolled.program.chunk_size
        L0, L1 = plan.lengths(C, seq_len)
        rolled = _roll_at(cand, fn, flat, layout, plan.unit * b0, L0)
    rolled_B = rolled if plan.fixed else _roll_at(cand, fn, flat, layout, plan.unit * b1, L0)
    rolled_L = _roll_at(cand, fn, flat, layout, plan.unit * b0, L1)
    # one chunk more: a number of the chunk count (1 / N) moves where one token more does not
    rolled_N = None if plan.structured else _roll_at(cand, fn, flat, layout, plan.unit * b0,
                                                     L0 + C)
    refuse_chunk_from_length(cand, {L: r for L, r in ((L0, rolled), (L1, rolled_L),
                                                      (L0 + C, rolled_N)) if r is not None})
    refuse_shape_constants(
        rolled, {"length": rolled_L, "batch size": rolled_B, "number of chunks": rolled_N},
        {"ref": f"batch {plan.unit * b0}, length {L0}", "length": f"length {L1}",
         "batch size": f"batch {plan.unit * b1}", "number of chunks": f"length {L0 + C}"},
        f"{_layer_name(cand)} (the loop at {cand.loop.src})")
    try:
        # one chunk more checks every size, and fits those of the chunk count (padded chunks)
        longer = None if rolled_N is None else ChunkCountCheck(
            C, rolled_N.outer, lambda L: _roll_at(cand, fn, flat, layout, plan.unit * b0, L).outer)
        outer = fit_template(rolled.outer, rolled_L.outer, rolled_B.outer, B0=b0, L0=L0, L1=L1,
                             B1=b1, longer=longer, corner=None if plan.fixed else lambda: _roll_at(
                                 cand, fn, flat, layout, plan.unit * b1, L1).outer,
                             whole_chunks=(C, lambda L: _roll_at(
                                 cand, fn, flat, layout, plan.unit * b0, L).outer)
                             if plan.structured else None,
                             what=f"code around the loop at {cand.loop.src} in {_layer_name(cand)}")
    except UnsupportedTTTError as e:
        raise _ShapeDependent(str(e)) from e
    notes = []
    if any(isinstance(e, WholeChunksOnly) for _, e in failures):
        notes.append(f"the loop at {cand.loop.src} runs over whole chunks only; converted for "
                     f"lengths that are multiples of {C}")
        layout = dataclasses.replace(layout, length_unit=C, loop_src=cand.loop.src,
                                     path=cand.path)
    elif plan.structured and seq_len is not None:
        usual_plan, usual = next(((p, e) for p, e in failures if not p.structured),
                                 (None, None))
        if usual is not None:
            own = not _code_runs_at(cand, fn, flat, layout, usual_plan, C, seq_len)
            whose = "the layer's own code failed" if own else \
                "the conversion could not trace the layer, whose code runs there,"
            notes.append(f"{whose} at lengths leaving another remainder modulo its chunk of {C} "
                         f"({_first_line(usual)}); converted for lengths leaving {seq_len % C}"
                         f"{'' if own else '; please report the layer'}")
            layout = dataclasses.replace(layout, traced_rest=(C, seq_len % C), path=cand.path,
                                         loop_src=cand.loop.src, rest_why=_first_line(usual),
                                         rest_own=own)
    if cand.probe_length is not None:
        notes.append(f"the example (length {seq_len}) is too short to run the loop; it was found "
                     f"by running the model at length {cand.probe_length}")
    batch_constant = next((e for _, e in failures if isinstance(e, BatchConstant)), None)
    if batch_constant is not None:
        notes.append(f"converted for batch size {plan.unit} only: {batch_constant}")
        layout = dataclasses.replace(layout, batch_unit=plan.unit, fixed_batch=True,
                                     path=cand.path, batch_constant=str(batch_constant))
    elif plan.unit > 1 or plan.fixed:
        first = failures[0]
        why = f"at {first[0].describe(C, seq_len)}: {_first_line(first[1])}"
        accepted = f"batch size {plan.unit} only" if plan.fixed else \
            f"batch sizes that are multiples of {plan.unit}"
        notes.append(f"converted for {accepted}: traced at {plan.describe(C, seq_len)} after "
                     f"the layer failed {why}")
        layout = dataclasses.replace(layout, batch_unit=plan.unit, fixed_batch=plan.fixed,
                                     path=cand.path, why=why)
    return RecognizedLayer(cand.path, cand, rolled, rolled_L, rolled_B, layout, in_spec, outer,
                           L0, L1, b0, b1, notes)


def _probe_shapes(plan: ProbePlan, C: int, seq_len) -> list[tuple[int, int]]:
    """The (batch, length) shapes ``plan`` traces at, the batch in units of ``plan.unit``."""
    b0, b1 = plan.batches
    L0, L1 = plan.lengths(C, seq_len)
    return [(b0, L0), (b0, L1)] + ([] if plan.fixed else [(b1, L0)])


def _code_runs_at(cand, fn, flat, layout, plan: ProbePlan, C: int, seq_len) -> bool:
    """Whether the layer's code as written runs at every shape of ``plan``: where it does, the
    plan's failure was the conversion's, not the code's (a few eager runs, made only then)."""
    try:
        for B, L in _probe_shapes(plan, C, seq_len):
            _run_at(cand, fn, flat, layout, plan.unit * B, L)
    except Exception:
        return False
    return True


def refuse_chunk_from_length(cand: LoopCandidate, rolled: dict[int, RolledLoop]) -> None:
    """Raise when the loop takes chunks of another size at another probe length: its chunk
    size is a function of the length, which no fixed-chunk plan computes."""
    sizes = {L: r.program.chunk_size for L, r in rolled.items()}
    if len(set(sizes.values())) < 2:
        return
    loop = cand.loop
    flat = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))[0]
    ranks = [x.dim() for x in flat if isinstance(x, torch.Tensor)]
    found = describe(length_values(loop.file, loop.line, (1, -2, max(ranks, default=3))))
    seen = ", ".join(f"{C} at length {L}" for L, C in sorted(sizes.items()))
    raise UnsupportedTTTError(
        f"{_layer_name(cand)}: the loop at {loop.src} takes chunks of another size at each "
        f"length ({seen}){f': {found}' if found else ''}. A converted loop runs chunks of one "
        "size at every length: make the chunk size a constant of the layer (pad the sequence "
        "to a multiple of it, or let the last chunk be partial).")


def _first_line(e: Exception) -> str:
    """The error's class (the public one an internal refinement escapes as) and the first line
    of its message."""
    public = next(c for c in type(e).__mro__ if not c.__name__.startswith("_"))
    return f"{public.__name__}: {first_line(e)}"


def _probe_failure(cand, failures, C, seq_len) -> ConversionError:
    """The error when no probe shape traced: the general case's own error when it is one of
    ours (it says what in the loop is unsupported), otherwise what every shape ran into."""
    first = failures[0][1]
    if isinstance(first, _ShapeDependent):      # escapes as the public class it refines
        err = UnsupportedTTTError(str(first))
        err.__cause__ = first
        return err
    if isinstance(first, ConversionError):
        return first
    where = user_frame(first)
    at = f" (first at {where})" if where else ""
    ours = next(((p, e) for p, e in failures if isinstance(e, ConversionError)), None)
    if ours is not None:    # the code runs there: the failure is the conversion's
        plan, e = ours
        err = UnsupportedTTTError(
            f"{_layer_name(cand)}'s own code fails at the shapes ttt2la traces first{at}: "
            f"{_first_line(first)}. Where it runs ({plan.describe(C, seq_len)}), ttt2la cannot "
            f"convert it: {e}")
        err.__cause__ = e
        return err
    shown = failures if len(failures) <= 2 else [failures[0], failures[-1]]
    tried = "; ".join(f"{p.describe(C, seq_len)}: {_first_line(e)}" for p, e in shown)
    err = UnsupportedTTTError(
        f"{_layer_name(cand)} runs at its example's shape, but its own code fails at every "
        f"shape ttt2la must trace it at{at}, its example's batch size included "
        f"({len(failures)} sets of shapes tried; {tried}). ttt2la traces a layer at two "
        "lengths at least (three chunk updates, then one more token or one more chunk) to make "
        "the converted layer work at any length: let the layer run at lengths other than the "
        "example's.")
    err.__cause__ = first
    return err


__all__ = ["recognize_layer", "RecognizedLayer", "InputLayout", "ProbePlan", "probe_plans",
           "layer_function", "params_and_buffers", "B0", "B1"]
