"""The module a converted TTT layer becomes.

A converted layer keeps its class (a subclass of it, so ``isinstance`` and parameter names are
unchanged) and its parameters; only ``forward`` changes. It runs the layer's *outer graph* — the
user's code around the loop, traced once and made shape-generic — with the loop replaced by
``LoopModule``, which runs the rewritten program on the chosen schedule. The loop is specialised
per batch size from its template on first use and cached, like a recompile; the code around it
is one graph per batch size taking each length's sizes with the call (``sized_graph``); the
user's Python loop is never run or re-traced again.

The converted layer is an ordinary module beyond that: it continues a sequence from a previous
call's state (``ttt_state``, see ``ttt2la.stream``), deep-copies sharing its compiled state,
pickles as the user's class plus the ``Recipe`` that converts it again, and enters a
``torch.compile`` graph as one call (``_run_in_graph``).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode

from .as_written import AsWritten, may_lose, races
from .attribute_guard import AttributeGuard, Change
from .frontend.call_signature import OtherValueError
from .forward_signature import forward_like
from .frontend.output_types import output_spec, typed_output
from .global_guard import GlobalGuard, LayerCode, read_off_classes
from .input_types import InputTypes
from .layout_guard import LayoutGuard
from .autograd_guard import AutogradGuard
from .gradient_stops import records_gradients
from .errors import (AlreadyConvertedError, ChangedAttributeError, ConversionError,
                     PartialChunkError, StreamingError, UnsupportedExportError,
                     UnsupportedShapeError, UnsupportedTTTError, first_line)
from .ir import (LOOP_MODULE, ShapeTemplate, SizeReader, TTTProgram, bind_loop_args,
                 params_and_buffers, with_memory_order)
from .locality import streaming_problem
from .lowering.chunking import chunk_layout
from .lowering.gradient_presence import body_dependencies, loop_reach, plan_reach, tied
from .lowering.lean_calls import lean_calls
from .lowering.plan import plan_at
from .meta_call import meta_call, on_meta
from .module_walk import ModuleWalk
from .original_class import ORIGINAL, original_class, written_call
from .torchscript import refuse_scripting, traced_call
from .recast import Signature, recast, recast_recipe, weights_signature
from .settings_guard import SettingsGuard
from .rejected_call import (conversion_fault, failed_where, failing_node, fails_in_loop,
                            rejected, rejected_as_written, steering)
from .stream import StreamCall, TTTState, advance, stateful_plan
from .submodule_hooks import hooked, hooks_described
from .as_found import as_found, buffers_kept
from .training_mode import training_dependence
from .compiled_plan import CompiledPlan, compiler_off, signature as compiled_signature
from .folded_weights import FoldedWeights
from .undifferentiable import refusal, refuse_backward
from .validation import check_flag


_ORDINAL = {2: "nd", 3: "rd"}

#: how a shape's runs list a second implementation: a plan may hand some calls to another
#: (a decay <= 0 to the generic plan, a short call to a loop over chunks)
SOME_CALLS = "; some calls: "


def record_run(runs: dict, key: str, what: str) -> None:
    """Record for the report that ``what`` ran a call at ``key``: each implementation that ran
    there is named once, the first one first, so a later call on another path does not hide
    the earlier calls'."""
    before = runs.get(key)
    if before is None:
        runs[key] = what
    elif what not in before.split(SOME_CALLS):
        runs[key] = before + SOME_CALLS + what


class LoopModule(torch.nn.Module):
    """Runs a lowered plan in the place of the loop: ``(*states0, *invariants) -> (out, *finals)``.

    The loop call of ``ttt2la.ir``'s outer-graph convention: the arguments follow the
    recognized loop (``interface``, its ``loop_interface``); passes may have dropped states
    (dead momentum of a frozen Θ) or invariants, so values are matched to the rewritten
    program by name. A state the program no longer carries keeps its initial value as its
    final value.
    """

    def __init__(self, program: TTTProgram, plan, interface: tuple[list[str], list[str]],
                 runs: dict | None = None, shape: str = "", skipped_first: frozenset = frozenset()):
        super().__init__()
        self.skipped_first = skipped_first      # states whose use the first iteration skips
        self.program = program
        self.plan = plan
        self.state_names, self.invariant_names = interface
        self.runs = runs if runs is not None else {}
        self.shape = shape
        self._dependencies = None       # the body's, for ``gradient_presence``
        self._missing: dict = {}        # (chunks, inputs) -> (plan, inputs each output misses)

    def plan_inputs(self, args) -> tuple[dict, list, list]:
        """The loop's arguments by name, and the program's initial states and invariants."""
        given = bind_loop_args((self.state_names, self.invariant_names), args)
        # the body was traced reading states a previous iteration produced (contiguous); an
        # initial state may be an expanded or transposed view of a parameter
        states0 = [given[s.name].contiguous() for s in self.program.states]
        invariants = [given[i.name] for i in self.program.invariants]
        return given, states0, invariants

    def forward(self, *args):
        given, states0, invariants = self.plan_inputs(args)
        stream_call = _stream_calls().get(id(self))
        if stream_call is None:
            plan = self.plan
            outputs, finals = plan(states0, invariants)
        else:
            plan = stateful_plan(self)
            where = f"the loop of {self.program.module_path or 'the model'} " \
                    f"({self.program.loop_src})"
            outputs, finals = advance(plan, self.program, states0, invariants,
                                      stream_call, where)
        key = self.shape if plan is self.plan else f"{self.shape}, stateful"
        record_run(self.runs, key, plan.implementation)
        outputs, finals = self._same_gradients_reached(plan, outputs, finals, states0, invariants)
        final_by_name = {s.name: f for s, f in zip(self.program.states, finals)}
        # the code after the loop was traced on the layout the user's code gave the output
        return (with_memory_order(outputs[0], self.program.outputs[0].memory_order),
                *(final_by_name.get(name, given[name]) for name in self.state_names))

    def _same_gradients_reached(self, plan, outputs, finals, states0, invariants):
        """The plan's outputs with the loop inputs the loop as written reaches and the plan
        does not tied on (``gradient_presence``): a parameter gets a zero gradient where the
        layer gives one, not None. Found once per plan, chunk count and inputs that record
        gradients; nothing is added where nothing is missing."""
        inputs = {("s", j): t for j, t in enumerate(states0)}
        inputs.update((("i", k), t) for k, t in enumerate(invariants))
        inputs = {k: t for k, t in inputs.items()
                  if isinstance(t, torch.Tensor) and t.requires_grad}
        program = self.program
        if not inputs or not torch.is_grad_enabled() or program.single_step \
                or not program.streams:
            return outputs, finals
        n = chunk_layout(program, list(invariants)).n_chunks
        key = (n, tuple(sorted(inputs)))
        found = self._missing.get(key)
        if found is None or found[0] is not plan:
            if self._dependencies is None:
                skipped = frozenset(j for j, s in enumerate(program.states)
                                    if s.name in self.skipped_first)
                self._dependencies = (body_dependencies(program, skipped),
                                      body_dependencies(program))
            out_reach, state_reach = loop_reach(*self._dependencies, program, n)
            wanted = [out_reach, *state_reach]
            got = [outputs[0], *finals]
            found = self._missing[key] = (plan, [
                sorted((w & inputs.keys()) - plan_reach(g, inputs)) if g is not None else []
                for w, g in zip(wanted, got)])
        missing = found[1]
        if not any(missing):
            return outputs, finals
        outputs = [tied(outputs[0], [inputs[k] for k in missing[0]]), *outputs[1:]]
        finals = [f if f is None else tied(f, [inputs[k] for k in m])
                  for f, m in zip(finals, missing[1:])]
        return outputs, finals


@dataclass
class ConvertedState:
    """Everything a converted layer needs at run time (kept out of ``state_dict``)."""

    program: TTTProgram                 # rewritten program at the canonical batch size
    body: ShapeTemplate                 # its body, generic in the batch size
    outer: ShapeTemplate                # the code around the loop, generic in (B, L)
    layout: SizeReader                  # reads (B, L) off a call's inputs
    plan: Any                           # the plan chosen for ``program`` (``plan_for``)
    interface: tuple                    # names of the recognized loop's states and invariants
    strict: bool = True                 # refuse to run another plan at a new batch size
    runs: dict = field(default_factory=dict)        # "batch B" -> what ran (shared with the report)
    fallbacks: dict = field(default_factory=dict)   # "batch B" -> why another plan runs there
    _outer_cache: dict = field(default_factory=dict)
    _loop_cache: dict = field(default_factory=dict)
    _lean_outer: ShapeTemplate | None = None    # ``outer`` calling torch functions (``lean_calls``)
    streamable: str | None = None       # why the layer cannot carry state ("" if it can)
    recipe: "Recipe | None" = None      # how to build it again (pickling)
    as_written: AsWritten | None = None  # an exact conversion's races against the user's code
    training_dependence: str = ""       # how the layer's code differs in training mode, if it does
    gradient_stop: str = ""             # where the loop stops gradients the plan would pass
    undifferentiable: str = ""          # how the layer as written fails when differentiated
    compile_break: str = ""             # why torch.compile runs it between graphs (``compile_break``)
    weights: Signature = ()             # the weights' names, dtypes and devices it was built for
    variant: str = ""                   # how its ``runs`` name it, when built again (``recast``)
    _recast: dict = field(default_factory=dict)     # signature -> the state built for it
    length_vouching: Any = None         # lengths the plan holds at (``length_vouching``)
    attributes: AttributeGuard | None = None    # the layer's plain attributes at conversion
    outside: GlobalGuard | None = None  # class attributes and globals its code reads, then
    settings: SettingsGuard | None = None   # torch's global settings its code reads, then
    input_layout: LayoutGuard | None = None     # the example's layout, where its code reads one
    autograd: AutogradGuard | None = None       # no input recording gradients, where it reads that
    typed_output: Callable | None = None    # gives its outputs their ``torch.Size`` values back
    walk: ModuleWalk | None = None      # its module tree at conversion, walked once a call
    skipped_first: frozenset = frozenset()  # states whose use the loop's first iteration skips
    _shape_cases: dict = field(default_factory=dict)    # input shapes -> ``_shape_case``
    input_types: InputTypes | None = None   # the example inputs' dtypes and devices
    caches: tuple = ()      # attributes the forward fills, unguarded (``filled_caches``)
    compiled: CompiledPlan | None = None    # its plan under torch.compile (``compiled_plan``)
    folded_weights: FoldedWeights | None = None     # the weights its folds were measured on

    def __deepcopy__(self, memo) -> "ConvertedState":
        """A copy for a copied model: the compiled parts (program, templates, plan) hold no
        parameter — the layer passes its own at every call — and are never changed after
        conversion, so they are shared; the caches of specialised graphs start empty; the
        report's dicts and the recipe are copied; races against the code as written start
        again."""
        return dataclasses.replace(
            self, runs=copy.deepcopy(self.runs, memo), fallbacks=copy.deepcopy(self.fallbacks,
                                                                               memo),
            _outer_cache={}, _loop_cache={}, _recast={}, _shape_cases={},
            recipe=copy.deepcopy(self.recipe, memo),
            as_written=None if self.as_written is None else AsWritten(),
            compiled=None if self.compiled is None else self.compiled.fresh())

    def for_weights(self, module: torch.nn.Module, weights: dict,
                    now: Signature | None = None) -> "ConvertedState":
        """The state to run ``module`` with its parameters and buffers ``weights`` (by name;
        ``now``: their ``weights_signature``, where the caller has it): this one for the
        weights it was built for, else one built again for theirs (``recast``)."""
        if now is None:
            now = weights_signature(weights)
        if now == self.weights or not self.weights:
            return self
        state = self._recast.get(now)
        if state is None:
            state = recast(module, self, now)
            state.compile_break = compile_break(state)
            self._recast[now] = state
        return state

    def refuse_padding(self, why: str) -> None:
        """Run no partial last chunk padded with zeros (``padded_chunk``): its program says
        ``why``, and the loops built from the program before are built again from it."""
        self.program.partial_chunk = why
        self._loop_cache.clear()
        self._outer_cache.clear()
        self.compile_break = compile_break(self)    # the plan decides at run time

    @property
    def schedule(self) -> str:
        return self.plan.schedule

    @property
    def implementation(self) -> str:
        return self.plan.implementation

    def loop_for(self, B: int) -> LoopModule:
        """The loop at batch size ``B``: the chosen plan carried over to the re-sized body; a
        fallback (``strict=False`` only) is recorded in ``fallbacks``."""
        loop = self._loop_cache.get(B)
        if loop is None:
            program = dataclasses.replace(self.program.clone(), body=self.body.instantiate(B, 0))
            plan, note = plan_at(self.plan, program, strict=self.strict)
            shape = f"batch {self._batch(B)}{self.variant}"
            if note is not None:
                self.fallbacks[shape] = note
            loop = self._loop_cache[B] = LoopModule(program, plan, self.interface, self.runs,
                                                    shape, self.skipped_first)
        return loop

    def outer_for(self, B: int, L: int):
        """The code around the loop at ``(B, L)``: one graph per batch size (its loop module is
        per batch size), taking the sizes of each length with the call (``sized_graph``), so a
        new length builds nothing. ``forward(weights, *flat)`` runs it."""
        sized = self._outer_cache.get(B)
        if sized is None:
            if self._lean_outer is None:    # the calls do not depend on the sizes: once
                self._lean_outer = self.outer.rewritten(lean_calls)
            sized = self._lean_outer.sized()
            setattr(sized.gm, LOOP_MODULE, self.loop_for(B))
            self._outer_cache[B] = sized
        return sized.at(B, L)

    def route(self, module: torch.nn.Module, args: tuple, kwargs: dict, flat: list,
              now: Signature | None = None):
        """What runs ``module(*args, **kwargs)`` (``flat``: its inputs flattened; ``now``: its
        weights' signature): ``None`` where the plan may take the call, else the call that runs
        instead (the code as written, or the refusal of a lossy conversion), as ``decide`` finds
        it."""
        case, B, L = self.decide(module, flat, now)
        return None if case is None else self._instead(case, module, args, kwargs, flat, B, L)

    def decide(self, module: torch.nn.Module, flat: list, now: Signature | None = None
               ) -> tuple[tuple | None, int, int]:
        """``(case, B, L)``: the call's sizes and, where the plan may not take it, why
        (``(kind, detail)``, which ``_instead`` turns into what runs instead; ``None`` where
        the plan may). Decided from the call's sizes, its inputs' dtypes and devices, the mode
        and gradient recording alone, so eager calls and ``torch.compile`` (which guards on
        those) decide alike; what only
        running the plan tells (a padding found not inert, a failing loop) is decided by the
        call that runs it. The one decision ``route``, ``__call__`` and ``kept_call`` share; a
        call ``sizes`` refuses raises its error (``now``: as ``other_types`` takes it)."""
        shapes = None if torch.compiler.is_compiling() or now is not None else _shapes(flat)
        found = self._shape_cases.get(shapes) if shapes is not None else None
        if found is None:
            found = self._shape_case(flat, now)
            if shapes is not None and len(self._shape_cases) < _SHAPE_CASES:
                self._shape_cases[shapes] = found
        first, B, L, then = found
        if first is not None:
            return first, B, L
        if module.training and self.training_dependence:
            return ("training", ""), B, L
        if self.gradient_stop and records_gradients(module, flat):
            return ("gradients", ""), B, L
        if then is not None:
            return then, B, L
        limit = self._transform_limit(B)
        if limit:
            return ("transform", limit), B, L
        return None, B, L

    def other_types(self, flat: list, now: Signature | None = None) -> str:
        """The call's first input in another dtype or on another device than the layer was
        traced with (``input_types``), described; ``""`` where there is none. ``now``: the
        weights' signature where it may not be the one this state was built for (a compiled
        call reads the state the layer was converted with), whose cast the inputs follow."""
        types = self.input_types
        if types is None:
            return ""
        if now is not None and self.weights and now != self.weights:
            types = types.cast(self.weights, now)
        return types.differs(flat)

    def _shape_case(self, flat: list, now: Signature | None = None) -> tuple:
        """``decide``'s part that reads the call's inputs alone: ``(first, B, L, then)``, the
        case that comes before the mode's and gradients' (a batch or image size the traces do
        not cover), the sizes, and the case after them (a length they do not cover, no
        tokens, inputs of other dtypes or devices than the traced ones). For a call of tensors it
        depends on their shapes, dtypes and devices only, so ``decide`` finds it once for each
        (``_shape_cases``); ``now`` as ``other_types`` takes it."""
        layout = self.layout
        if self.as_written is not None:
            other_batch = getattr(layout, "untraced_batch", _NONE_OTHER)(flat)
            if other_batch:
                return ("untraced batch", other_batch), 0, 0, None
            other_image = getattr(layout, "other_image", _NONE_OTHER)(flat)
            if other_image:
                return ("other image", other_image), 0, 0, None
            other_values = getattr(layout, "other_values", _NONE_OTHER)(flat)
            if other_values:
                return ("other values", other_values), 0, 0, None
        # plain ints: the graphs are built per size (under torch.compile's symbolic sizes too)
        B, L = layout.sizes(flat)
        B, L = int(B), int(L)
        other = self.other_types(flat, now)
        if other:
            return None, B, L, ("input types", other)
        untraced = layout.untraced_length(L)
        if untraced:
            return None, B, L, ("untraced length", untraced)
        if L == 0:
            return None, B, L, ("length zero", "")
        if B == 0 and self.as_written is not None:
            return None, B, L, ("batch zero", "")
        return None, B, L, None

    def _instead(self, case: tuple, module: torch.nn.Module, args: tuple, kwargs: dict,
                 flat: list, B: int, L: int):
        """The call that runs instead of the plan for ``decide``'s ``case``."""
        kind, detail = case
        written = written_call(module, args, kwargs)
        if kind == "untraced batch":
            return lambda: self._at_untraced_batch(detail, written, flat)
        if kind == "other image":
            return lambda: self._at_other_image(detail, written, flat)
        if kind == "other values":
            return lambda: self.with_other_values(detail, written)
        if kind == "training":
            return lambda: self._in_training(written, B, L)
        if kind == "gradients":
            return lambda: self._stopped_gradients(written, B, L)
        if kind == "untraced length":
            return lambda: self._at_untraced_length(detail, written, B, L)
        if kind == "input types":
            return lambda: _other_types_between_graphs(self._of_other_types, detail, module,
                                                       written, B, L)
        if kind == "length zero":
            return lambda: self._at_length_zero(written, B)
        if kind == "batch zero":
            return lambda: self._at_batch_zero(written)
        return lambda: self._under_transform(detail, written, B, L)

    def __call__(self, module: torch.nn.Module, weights: dict, args: tuple, kwargs: dict,
                 flat: list | None = None):
        """``module(*args, **kwargs)`` with its parameters and buffers ``weights``
        (``params_and_buffers``; ``flat``: the inputs flattened, where the caller has them):
        what ``decide`` finds runs instead, else the plan."""
        if flat is None:
            flat = _flat_inputs(args, kwargs)
        case, B, L = self.decide(module, flat)
        if case is not None:
            return self._instead(case, module, args, kwargs, flat, B, L)()
        written = written_call(module, args, kwargs)
        gm = self.outer_for(B, L)
        # ``forward``, not the module call: fx's call prints the generated code of a failing
        # line to stderr, where ``rejected`` names the user's line instead
        plan = self._plan_call(module, gm, weights, flat, B)
        vouching = self.length_vouching
        if vouching is not None and not vouching.holds(B, L):
            with buffers_kept(module):      # the check's runs are not the call's
                unvouched = self._unvouched_length(vouching, plan, written, B, L)
            if unvouched is not None:
                return unvouched()
        try:
            if self.as_written is None or not races(module, flat):
                return plan()
            return self.as_written.call(
                _race_key(B, L, flat), plan, written, lambda: may_lose(self.loop_for(B).plan, L),
                self.runs, lambda: AsWritten.shape(self._batch(B), L))
        except PartialChunkError as e:
            return self._written_instead(
                written, B, L, "partial last chunk",
                f"the plan would pad the last chunk, and the padding changes {e.what}",
                f"its last chunk is partial, where the plan's zero padding would change {e.what}",
                refusal=e)
        except Exception as e:
            return self._plan_failed(e, module, written, weights, flat, B, L)

    def _plan_call(self, module: torch.nn.Module, gm, weights: dict, flat: list, B: int
                   ) -> Callable:
        """The call of the plan ``gm`` on ``weights`` and ``flat``: eager, or through the layer's
        compiled entry where ``convert(compile=)`` asked for one and it can run (not under
        another compiler's tracing, nor past the recompile limit, nor after a failure)."""
        eager = lambda: gm.forward(weights, *flat)     # noqa: E731
        compiled = self.compiled
        if compiled is None or compiled.broken or self.compile_break \
                or torch.compiler.is_compiling() or torch.jit.is_tracing() or compiler_off():
            return eager
        loop = self.loop_for(B)             # built with ``gm``: what its report rows are named

        def eagerly(why: str) -> Callable:
            self.fallbacks[f"{loop.shape}, compiled"] = why
            return eager
        tensors = [*weights.values(), *flat]
        if not all(isinstance(t, torch.Tensor) for t in flat):
            return eagerly("calls with values other than tensors among their inputs run the "
                           f"plan eagerly, not under {compiled.name}")
        key = compiled_signature(tensors)
        if compiled.full(key):
            return eagerly(f"{compiled.name} compiled the plan for as many call shapes as "
                           "TorchDynamo's recompile limit allows; calls of other shapes run it "
                           "eagerly")

        def call():
            out = compiled(module._ttt2la_key, tensors, key, eager)
            if compiled.broken:
                self.fallbacks[loop.shape] = compiled.broken
            else:
                record_run(self.runs, loop.shape,
                           f"{loop.plan.implementation}, under {compiled.name}")
                compiled.batches.add(B)
            return out
        return call

    def _plan_failed(self, error: Exception, module: torch.nn.Module, written, weights: dict,
                     flat: list, B: int, L: int):
        """A call the plan raised ``error`` on. The code as written decides whose the error
        is: where it fails too, the error is the layer's own, named at its line; where it runs,
        the converted graphs are at fault — an exact conversion answers with the code as
        written (a warning and the report's runs say so), a lossy one refuses, saying so."""
        if isinstance(error, ConversionError) or steering(error):
            raise error
        gm = self.outer_for(B, L)
        inputs = [weights, *flat]
        if self.as_written is not None and fails_in_loop(gm, inputs):
            return self._loop_failed(error, written, B, L)
        try:
            if self.as_written is not None:
                out = written()
            else:
                with buffers_kept(module):  # the check's run is not the call's
                    written()
        except Exception:
            raise self._rejected(error, gm, inputs) from error
        why = conversion_fault(error, gm, inputs, loop_src=str(self.program.loop_src),
                               implementation=self.implementation)
        if self.as_written is None:
            refusal = UnsupportedShapeError(
                f"{self._where()}: {why}, although the layer as written runs this call: its "
                "lossy conversion does not cover this call's shape. Convert the layer again "
                "with example inputs of this shape, or run the original layer for it; please "
                "report this call with the model.")
            refusal.plan_fault = why        # the conversion's check words it for the example
            raise refusal from error
        return self._ran_as_written(why, out, B, L, "the converted graphs failed")

    def kept_call(self, module: torch.nn.Module, args: tuple, kwargs: dict, flat: list):
        """``module(*args, **kwargs)`` (``flat``: its inputs flattened) run as written where
        the call is at a shape whose race kept the code as written (``AsWritten.kept``), else
        ``NOT_KEPT``. Asked before the layer's guards and weights: such a call runs no part of
        any plan, and its code as written reads the hooks, attributes and weights itself. A
        call ``decide`` sends elsewhere (training, a ``torch.func`` transform, another image
        size, a call ``sizes`` refuses), or at a length the traces do not vouch for, takes the
        full path, whose report entries and errors are its own."""
        sizes = self._kept(module, flat)
        if sizes is None:
            return NOT_KEPT
        signature = getattr(self.layout, "signature", None)
        shapes = _shapes(flat)
        if shapes is not None and len(self.as_written.given) < _SHAPE_CASES \
                and (signature is None or signature.as_given(args, kwargs)):
            self.as_written.given.add(shapes)
        return self._run_kept(module, args, kwargs, flat, *sizes)

    def kept_as_given(self, module: torch.nn.Module, args: tuple):
        """``kept_call`` for a call of positional tensors ``args`` at input shapes that ran
        the code as written before, given as the example was spelled (``AsWritten.given``):
        known by its shapes before it is spelled or flattened, so a call that runs the user's
        code costs its decision alone; ``NOT_KEPT`` for any other call (and under
        ``torch.jit.trace`` or ``torch.export``, whose calls say what they record)."""
        if _shapes(args) not in self.as_written.given or torch.jit.is_tracing() \
                or torch.compiler.is_exporting():
            return NOT_KEPT
        sizes = self._kept(module, args)
        return NOT_KEPT if sizes is None else self._run_kept(module, args, {}, args, *sizes)

    def _kept(self, module: torch.nn.Module, flat) -> tuple[int, int] | None:
        """The call's ``(B, L)`` where it is at a shape whose race kept the code as written and
        ``decide`` sends it nowhere else, else ``None``."""
        kept = self.as_written.kept if self.as_written is not None else None
        if not kept or not races(module, flat):
            return None
        try:
            case, B, L = self.decide(module, flat)
        except Exception:
            return None
        vouching = self.length_vouching
        if case is not None or _race_key(B, L, flat) not in kept or vouching is not None \
                and not vouching.holds(B, L):
            return None
        return B, L

    def _run_kept(self, module: torch.nn.Module, args: tuple, kwargs: dict, flat, B: int,
                  L: int):
        """The code as written on a kept call; its failure is judged as the full path's."""
        classes = self.as_written.forwards
        original = classes.get(type(module))
        if original is None:
            original = classes[type(module)] = original_class(type(module))
        try:          # its ``forward`` looked up at each call: one rebound since runs
            return original.forward(module, *args, **kwargs)
        except Exception as e:
            weights = params_and_buffers(module)
            if on_meta(weights, []):
                return meta_call(module, args, kwargs, stateful=False)
            return self.for_weights(module, weights)._written_failed(
                e, written_call(module, args, kwargs), weights, list(flat), B, L)

    def _written_failed(self, error: Exception, written, weights: dict, flat: list, B: int,
                        L: int):
        """A call of an exact conversion that raised ``error``: where the converted loop fails
        on it too, the code as written decides (``_loop_failed``); else the error is raised,
        named at the user's line."""
        gm = self.outer_for(B, L)
        if not isinstance(error, ConversionError) and fails_in_loop(gm, [weights, *flat]):
            return self._loop_failed(error, written, B, L)
        raise self._rejected(error, gm, [weights, *flat]) from error

    def _at_untraced_length(self, why: str, written, B: int, L: int):
        """A call at a length the layer could not be traced at: an exact conversion runs the code
        as written (which raises its own error where it fails, naming its line); a lossy one
        refuses."""
        return self._written_instead(written, B, L, "untraced length", why, f"at {why}",
                                     refusal=UnsupportedShapeError(
            f"{self._where()} was called at {why}. Call it at the lengths it was traced at, or "
            "convert it again with example inputs of the length you call it with."))

    def _of_other_types(self, which: str, module: torch.nn.Module, written, B: int, L: int):
        """A call with an input in another dtype or on another device than the traced ones
        (``which`` says which): the graphs hold no cast the code makes of it, so an exact
        conversion runs the code as written. A lossy one refuses; where the code as written
        fails on the call too, its own error, naming its line, says what to pass."""
        if self.as_written is None:
            with buffers_kept(module):      # the check's run is not the call's
                self._as_written(written, f"with {which}")
        return self._written_instead(written, B, L, "input types", which, f"with {which}",
                                     refusal=UnsupportedShapeError(
            f"{self._where()} was called with {which}. Pass inputs as the layer was traced "
            "with, or convert it again with example inputs like this call's (cast the model's "
            "weights too: the inputs follow them)."))

    def _unvouched_length(self, vouching, plan, written, B: int, L: int):
        """At a length the traces do not vouch for (the code computes Python values of the
        length): ``None`` where the plan was checked to agree with the code as written there
        (a lossy conversion: where its code decides as at the traced shapes), else what to run
        instead (the code as written; a lossy conversion refuses)."""
        if self.as_written is None:
            if not vouching.decided_alike(B, L):
                raise vouching.refusal(self._where(), B, L)
            self.runs.setdefault(f"batch {self._batch(B)}, length {L}, length values",
                                 "plan: its code decides as at the shapes it was traced at")
            return None
        if vouching.check(B, L, plan, written):
            self.runs.setdefault(f"batch {self._batch(B)}, length {L}, length values",
                                 "plan: checked against the code as written at this shape")
            return None
        return lambda: self._written_instead(
            written, B, L, "length values",
            f"its code computes {vouching.what}, and the plan differs from it at this shape",
            f"at batch size {self._batch(B)}, length {L}, where its code computes "
            f"{vouching.what}", refusal=None)

    def _at_untraced_batch(self, why: str, written, flat: list):
        """A call at a batch size other than the one a number of the traced code was derived
        from: an exact conversion runs the code as written (a lossy one is refused by
        ``sizes``)."""
        layout = self.layout
        x = flat[layout.ref]
        B, L = x.shape[layout.batch_axis[layout.ref]], layout.length_of(x)
        self.runs[f"batch {B}, length {L}, untraced batch size"] = f"as written: {why}"
        return self._as_written(written, f"at {why}")

    def _at_other_image(self, image: str, written, flat: list):
        """A call of a single step over an image's positions at another image size than the
        example's: an exact conversion runs the code as written (a lossy one is refused by
        ``sizes``)."""
        x = flat[self.layout.ref]
        B = x.shape[self.layout.batch_axis[self.layout.ref]]
        self.runs[f"batch {B}, {image}"] = f"as written: {self.layout.image_why}"
        return self._as_written(written, f"at {image}")

    def with_other_values(self, which: str, written):
        """A call with a plain Python argument (such as ``h, w``) of another value than the
        example's, which the conversion built into its graphs: an exact conversion runs the code
        as written (a lossy one is refused by ``sizes``, naming the argument)."""
        self.runs[f"called with {which}"] = (
            "as written: the conversion built the value it was converted with into its graphs")
        return self._as_written(written, f"with {which}")

    def _at_length_zero(self, written, B: int):
        """A call of no tokens, where the loop never runs: an exact conversion returns what the
        code as written returns (its own error, naming its line, where it fails); a lossy one,
        whose simplified function the code as written does not compute, refuses."""
        if self.as_written is None:
            raise UnsupportedShapeError(
                f"{self._where()} was called with an empty sequence (length 0), where its loop "
                "runs no iteration; a lossy conversion does not run the layer as written. Skip "
                "the call for an empty sequence, or call it with at least one token.")
        self.runs[f"batch {B}, length 0"] = "as written: an empty sequence, where the loop " \
                                            "runs no iteration"
        return self._as_written(written, "at length 0 (an empty sequence)")

    def like_another_call(self, module: torch.nn.Module, args: tuple, kwargs: dict, n: int):
        """A call made as the model's example run made its ``n``-th call of the layer (another
        keyword, a state passed where the first call left it out), not as the call the layer was
        converted from: an exact conversion runs the code as written, the report's runs saying
        so; a lossy one, which converts the first call only, refuses."""
        if self.as_written is None:
            raise UnsupportedShapeError(
                f"{self._where()} was called as the model's example run calls it the {n}"
                f"{_ORDINAL.get(n, 'th')} time, otherwise than the call it was converted from; "
                "a lossy conversion converts a layer's first call only, and does not run the "
                "code as written for others. Convert at an exact level (0–2), where such calls "
                "run the code as written, or call the layer one way.")
        self.runs[f"made as call {n} of the example run"] = (
            "as written: made otherwise than the call the layer was converted from (its first "
            "in the example run)")
        return self._as_written(written_call(module, args, kwargs),
                                f"made as its call {n} in the example run")

    def _at_batch_zero(self, written):
        """A call of an empty batch, which costs nothing as written: an exact conversion returns
        what the code as written returns, its own error (naming its line) where it fails."""
        self.runs["batch 0"] = "as written: an empty batch"
        return self._as_written(written, "at batch size 0 (an empty batch)")

    def _refuse_empty_piece(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        """A stateful call with no tokens: the layer's own error where its code fails on an
        empty sequence (naming its line), else a refusal naming the layer."""
        self._as_written(written_call(module, args, kwargs),
                         "at length 0 (an empty sequence)")
        raise StreamingError(
            f"{self._where()} was called with an empty sequence (length 0) and asked to carry "
            "its state: there are no tokens to continue it with. Skip the call for an empty "
            "piece (the state stays as it was), or pass at least one token.")

    def _loop_failed(self, error: Exception, written, B: int, L: int):
        """A call an exact conversion's loop fails on: the code as written decides. Where it
        fails too, its own error is raised, naming its line; where it runs, its output is the
        answer (the function is the same), with a warning and the report's runs saying so."""
        why = (f"the converted loop failed on this call "
               f"({type(error).__name__}: {first_line(error)})")
        return self._ran_as_written(why, self._as_written(written, why), B, L, "the loop failed")

    def _ran_as_written(self, why: str, out, B: int, L: int, case: str):
        """``out``, the code as written's answer to a call the converted graphs failed on
        (``why``), with a warning and the report's runs saying so (``case`` names the call)."""
        self.runs[f"batch {self._batch(B)}, length {L}, {case}"] = f"as written: {why}"
        warnings.warn(f"ttt2la: {self._where()}: {why}; ran the layer as written, which takes it. "
                      "Please report this call with the model.", RuntimeWarning, stacklevel=4)
        return out

    def _transform_limit(self, B: int) -> str:
        """Why the plan at batch size ``B`` cannot run this call, made under a ``torch.func``
        transform (``grad``, ``vmap``, ``jacrev``, ...); "" where it can, or outside one."""
        if not torch._C._are_functorch_transforms_active():
            return ""
        return getattr(self.loop_for(B).plan, "transform_limit", "")

    def _under_transform(self, limit: str, written, B: int, L: int):
        """A call under a ``torch.func`` transform of a plan whose runtime has no rules for it
        (``limit`` says why): an exact conversion runs the code as written, which computes the
        same function, with a warning and the report's runs saying so; a lossy one, whose
        function the code as written does not compute, refuses."""
        why = f"called under a torch.func transform (grad, vmap, jacrev, ...), where {limit}"
        out = self._written_instead(
            written, B, L, "torch.func transform", why, "under a torch.func transform",
            refusal=UnsupportedTTTError(
                f"{self._where()} was {why}, and its lossy conversion does not run the layer as "
                "written. Take gradients with torch.autograd.grad or .backward() (per-sample "
                "gradients by a loop over the samples), or convert it at an exact level."))
        warnings.warn(f"ttt2la: {self._where()} was {why}; ran the layer as written, which "
                      "computes the same function without the plan's speed-up.",
                      RuntimeWarning, stacklevel=3)
        return out

    def _in_training(self, written, B: int, L: int):
        """A call in training mode of a layer whose code differs there (``training_mode``): its
        graphs hold the evaluation-mode function, so an exact conversion runs the code as
        written (and says so in the report's runs); a lossy one computes another function,
        whose training-mode form was never derived, and refuses."""
        return self._written_instead(
            written, B, L, "training mode",
            f"converted for evaluation mode, and {self.training_dependence}", "in training mode",
            refusal=UnsupportedTTTError(
                f"{self._where()} was converted for evaluation mode, and "
                f"{self.training_dependence}: its lossy conversion has no training-mode form. "
                "Call .eval() on it, or convert a layer whose code does not depend on the mode "
                "(dropout or batch norm outside the layer that owns the loop)."))

    def _stopped_gradients(self, written, B: int, L: int):
        """A call that records gradients of a layer whose loop stops some (``gradient_stops``):
        the plan would pass them, so an exact conversion runs the code as written, and a lossy
        one, whose function has no such code, refuses."""
        return self._written_instead(
            written, B, L, "gradients", f"{self.gradient_stop}, which the plan would pass",
            "recording gradients the loop stops", refusal=UnsupportedTTTError(
                f"{self._where()} stops gradients inside its loop ({self.gradient_stop}), which "
                "its lossy conversion does not keep. Call it under torch.no_grad(), or remove "
                "the stop from the layer and convert it again."))

    def hooked_call(self, module: torch.nn.Module, args: tuple, kwargs: dict, stateful: bool):
        """A call while hooks would run on the layer's submodules (``submodule_hooks``): the
        graphs never call those submodules, so an exact conversion runs the code as written,
        where the hooks run (and says so in the report's runs); a lossy one computes another
        function and refuses, as does a call carrying state between calls."""
        found = hooks_described(module)
        remedy = "Remove the hook to run the converted layer, or run the original model."
        if stateful:
            raise StreamingError(
                f"{self._where()} cannot carry its state between calls while there is "
                f"{found}: the converted layer never calls that submodule. {remedy}")
        if self.as_written is None:
            raise UnsupportedTTTError(
                f"{self._where()} computes a simplified function (a lossy conversion) and "
                f"there is {found}, which its graphs cannot run: they never call that "
                f"submodule, and the code as written computes another function. {remedy}")
        B, L = (int(n) for n in self.layout.sizes(_flat_inputs(args, kwargs)))
        self.runs[f"batch {self._batch(B)}, length {L}, hooks on submodules"] = f"as written: {found}"
        return self._as_written(
            written_call(module, args, kwargs),
            f"while there is {found}")

    def changed_call(self, module: torch.nn.Module, args: tuple, kwargs: dict, change: Change,
                     stateful: bool):
        """A call after a plain attribute the layer was traced with changed
        (``attribute_guard``): the graphs hold its old value, so an exact conversion runs the
        code as written (and says so in the report's runs), and a lossy one, whose function the
        code as written does not compute, refuses, as does a call carrying state."""
        found = change.describe()
        again = "convert the layer again to run it converted with the new value"
        if stateful:
            raise StreamingError(
                f"{self._where()} cannot carry its state between calls: {found}, and its "
                f"converted graphs hold the old value. Set it back, or {again}.")
        if self.as_written is None:
            raise ChangedAttributeError(
                f"{self._where()}: {found}. Its lossy conversion was traced with the old value "
                "and the code as written computes another function, so it cannot run. Convert "
                "the original layer again with the new value (or set it back).",
                attribute=change.where, then=change.then, now=change.now)
        B, L = (int(n) for n in self.layout.sizes(_flat_inputs(args, kwargs)))
        self.runs[f"batch {self._batch(B)}, length {L}, attribute changed"] = \
            f"as written: {found}; {again}"
        return self._as_written(
            written_call(module, args, kwargs),
            f"since {found}")

    def _written_instead(self, written, B: int, L: int, case: str, note: str, why: str,
                         refusal: Exception):
        """A call the plan cannot take as the code does: an exact conversion runs the code as
        written, the report's runs saying so (``case`` names the call, ``note`` what the plan
        would do; ``why`` goes into the code's own errors); a lossy one, whose function the code
        does not compute, raises ``refusal``."""
        if self.as_written is None:
            raise refusal
        out = self._as_written(written, why)    # a call the code fails on too ran nothing
        self.runs[f"batch {self._batch(B)}, length {L}, {case}"] = f"as written: {note}"
        return out

    def _as_written(self, written, why: str):
        """``written()``, the layer's code as written, its errors raised as a
        ``RejectedCallError`` naming the user's line (``rejected_as_written``). Under
        ``torch.compile`` it runs outside TorchDynamo (``_written_between_graphs``), whether
        the call is being traced or runs after a graph break; ``torch.export`` traces it."""
        try:
            if torch.compiler.is_exporting():
                return written()
            return _written_between_graphs(written)
        except Exception as e:
            raise rejected_as_written(e, path=self.program.module_path, why=why,
                                      expected=self._expected()) from e

    def _batch(self, B: int) -> int:
        """The batch size a call of ``B`` batch units has, as the report names it."""
        return B * getattr(self.layout, "batch_unit", 1)

    def _where(self) -> str:
        return f"{self.program.module_path or 'this layer'} (the loop at {self.program.loop_src})"

    def _rejected(self, error: Exception, gm, inputs: list) -> Exception:
        """What to raise for ``error`` from running ``gm``: a ``ConversionError`` as it is, any
        other error as the ``RejectedCallError`` naming the user's line (``rejected_call``)."""
        return rejected(error, gm, inputs, path=self.program.module_path,
                        loop_src=str(self.program.loop_src), implementation=self.implementation,
                        expected=self._expected())

    def _expected(self) -> str:
        """The calls the layer was converted for, as a message names them ("" if unknown)."""
        layout = self.layout
        signature = getattr(layout, "signature", None)
        return "" if signature is None else signature.describe(layout.batch_axis,
                                                                layout.token_axis)

    def stateful_call(self, module: torch.nn.Module, weights: dict, args: tuple, kwargs: dict,
                      state: TTTState | None) -> tuple[Any, TTTState]:
        """``module(*args, **kwargs)`` continuing from ``state`` (``None``: the layer's initial
        fast weights): the output for these tokens and the state after them."""
        if state is not None and not isinstance(state, TTTState):
            original = original_class(type(module))
            own = "ttt_state" in _parameters(original.forward)
            clash = (f"; {original.__name__}.forward has a parameter of that name too, which "
                     "a converted layer takes for its streaming state: pass that argument by "
                     "position, or rename the parameter") if own else ""
            raise StreamingError(
                f"ttt_state must be a ttt2la.TTTState returned by an earlier call of this "
                f"layer (or None), got {type(state).__name__}{clash}")
        flat = _flat_inputs(args, kwargs)
        B, L = self.layout.sizes(flat)
        other = self.other_types(flat)
        if other:               # the code's own error where it fails too, else the refusal
            with buffers_kept(module):
                self._as_written(written_call(module, args, kwargs), f"with {other}")
            raise StreamingError(
                f"{self._where()} cannot carry its fast-weight state through a call with "
                f"{other}: its graphs hold no cast the code makes of it. Pass inputs as the "
                "layer was traced with, or convert it again with example inputs like these.")
        untraced = self.layout.untraced_length(L)
        if untraced:                    # the code as written carries no state between calls
            raise UnsupportedShapeError(
                f"{self._where()} cannot carry its fast-weight state through a call at {untraced}: "
                "call it with pieces of the lengths it was traced at.")
        vouching = self.length_vouching
        if vouching is not None and not vouching.holds(B, L):
            raise UnsupportedShapeError(
                f"{self._where()} cannot carry its fast-weight state through a call at "
                f"{vouching.shape(B, L)}: its code computes Python values of "
                f"{' and '.join(vouching.by)} ({vouching.what}), so a piece of another shape may "
                "run another function. Call it with pieces of the shapes it was traced at.")
        if self.gradient_stop and records_gradients(module, flat):
            raise StreamingError(
                f"{self.program.module_path or 'this layer'} stops gradients inside its loop "
                f"({self.gradient_stop}), which a state carried between calls does not keep. "
                "Stream it under torch.no_grad(), or run whole sequences.")
        if module.training and self.training_dependence:
            raise StreamingError(
                f"{self.program.module_path or 'this layer'} was converted for evaluation mode, "
                f"and {self.training_dependence}: a state carried between calls runs the "
                "converted graphs only. Call .eval() on it to decode.")
        if L == 0:
            self._refuse_empty_piece(module, args, kwargs)
        limit = self._transform_limit(B)
        if limit:
            raise StreamingError(
                f"{self._where()} cannot carry its fast-weight state through a call under a "
                f"torch.func transform (grad, vmap, jacrev, ...): {limit}. Stream it outside "
                "the transform, or run whole sequences.")
        if self.streamable is None and L > 0 and B > 0:   # else nothing to probe with
            try:
                self.streamable = streaming_problem(self, module, flat) or ""
            except Exception as e:              # the probe runs the layer's code on this call
                raise self._rejected(e, self.outer_for(B, L), [weights, *flat]) from e
        if self.streamable:
            raise StreamingError(
                f"{self.program.module_path or 'this layer'} cannot carry its fast-weight "
                f"state from one call to the next: {self.streamable} (the loop is at "
                f"{self.program.loop_src}). Only the loop carries state, so the code around it "
                "must treat tokens one by one; run whole sequences instead.")
        gm = self.outer_for(B, L)
        loop = self.loop_for(B)
        call = StreamCall(state, tokens=L)
        calls = _stream_calls()
        calls[id(loop)] = call
        try:
            y = gm.forward(weights, *flat)
        except Exception as e:
            raise self._rejected(e, gm, [weights, *flat]) from e
        finally:
            del calls[id(loop)]
        return y, call.state_out


#: The ``StreamCall`` of every loop running a stateful call, by the loop's id, per thread: a
#: plain call of the same layer on another thread runs the plan, never that call's state.
_STREAMING = threading.local()


def _stream_calls() -> dict:
    calls = getattr(_STREAMING, "calls", None)
    if calls is None:
        calls = _STREAMING.calls = {}
    return calls


#: What ``ConvertedState.kept_call`` returns for a call no race kept as written.
NOT_KEPT = object()


def _NONE_OTHER(flat: list) -> str:
    """A layout that reads no other batch or image size off a call (no batch size derived
    into the traced code, no single step over an image's positions)."""
    return ""


#: The most input shapes a layer remembers ``decide``'s shape part for (a model fed every
#: length finds the rest each call, as before).
_SHAPE_CASES = 512


def _shapes(flat: list) -> tuple | None:
    """The shapes, dtypes and devices of a call's inputs, where they are all tensors (``None``
    where not: a value among them is compared by the call's signature each call)."""
    shapes = []
    for t in flat:
        if not isinstance(t, torch.Tensor):
            return None
        shapes.append((t.shape, t.dtype, t.device))
    return tuple(shapes)


def _race_key(B: int, L: int, flat: list) -> tuple:
    """The shape a race against the code as written is run at: batch, length and the dtype of
    the first tensor input."""
    for t in flat:
        if isinstance(t, torch.Tensor):
            return B, L, t.dtype
    return B, L, None


def _flat_inputs(args, kwargs) -> list:
    """The call's inputs flattened (spelled as the example call, ``_converted_forward``), in
    the memory layout the caller gave them: the outer graph reads
    any layout (the frontend makes its views reshapes), so a slice of a longer sequence is not
    copied. Plain tensors are leaves, so a call of tensors alone is its own flattening (a dict
    flattens in its keys' order)."""
    if all(type(a) in _LEAVES for a in args) and all(type(v) in _LEAVES for v in kwargs.values()):
        return [*args, *kwargs.values()]
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return flat


#: Types ``pytree`` takes as leaves, whatever is registered: tensors and parameters.
_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter})


_CLASSES: dict[type, type] = {}


def _converted_forward(self, *args, ttt_state=None, return_ttt_state=False, **kwargs):
    """The converted layer; with ``return_ttt_state=True`` (or a ``ttt_state``) it continues
    the sequence ``ttt_state`` left (``None``: from the start) and, when asked, returns
    ``(output, state_after)`` (``ttt2la.stream``). A layer whose own backward fails refuses a
    backward through its output as well (``undifferentiable``). A call is first spelled as the
    example call was (``InputLayout.spelled``): its arguments matched to the forward's
    parameters by name, in the order the converted graphs take them. Under ``torch.jit.trace``
    an exact conversion runs the code as written (``torchscript``)."""
    if type(return_ttt_state) is not bool:
        check_flag(return_ttt_state, "return_ttt_state")
    state = self._ttt2la
    if not torch.compiler.is_compiling() and state.as_written is not None \
            and state.as_written.given and not kwargs and ttt_state is None \
            and not return_ttt_state:
        out = state.kept_as_given(self, args)
        if out is not NOT_KEPT:
            return out
    if getattr(state.layout, "other_calls", ()) and ttt_state is None and not return_ttt_state:
        n = state.layout.other_example_call(args, kwargs)
        if n:
            return state.like_another_call(self, args, kwargs, n)
    spelled = getattr(state.layout, "spelled", None)
    if spelled is not None:
        try:
            args, kwargs = spelled(args, kwargs)
        except OtherValueError as e:
            if state.as_written is None or ttt_state is not None or return_ttt_state:
                raise
            return state.with_other_values(e.which, written_call(self, args, kwargs))
    if torch.jit.is_tracing():      # before any plan op: the tracer records what runs
        return traced_call(self, args, kwargs, _flat_inputs(args, kwargs),
                           ttt_state is not None or return_ttt_state, export_refusal(state))
    if torch.compiler.is_exporting():
        return _exported_call(self, args, kwargs, ttt_state, return_ttt_state)
    flat = _flat_inputs(args, kwargs)
    if state.undifferentiable and records_gradients(self, flat):
        where = state._where()
        if ttt_state is not None or return_ttt_state:
            raise StreamingError(
                f"{where} cannot carry its state through a call that records gradients: "
                f"{refusal(where, state.undifferentiable)}")
        return refuse_backward(_converted_call(self, args, kwargs, flat=flat),
                               refusal(where, state.undifferentiable))
    return _converted_call(self, args, kwargs, ttt_state, return_ttt_state, flat)


def export_refusal(state: "ConvertedState") -> str:
    """Why ``torch.export`` cannot trace the layer's plan ("" when it can): forward-mode
    derivatives taken at run time do not trace under export's fake tensors."""
    if getattr(state.plan, "forward_ad", False):
        return "its plan takes an affine update's coefficients by forward-mode differentiation"
    return ""


def _exported_call(self, args: tuple, kwargs: dict, ttt_state, return_ttt_state: bool):
    """The converted layer traced by ``torch.export``: its plan's tensor ops at the (batch,
    length) being exported, or an ``UnsupportedExportError`` saying why the plan cannot be
    traced and what to export instead — never a raw error from inside export's tracing."""
    state = self._ttt2la
    instead = ("Export the original model instead (ttt2la.convert leaves it untouched), or run "
               "the converted layer eagerly or under torch.compile")
    reason = export_refusal(state)
    symbolic = [d for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)
                for d in x.shape if isinstance(d, torch.SymInt)]
    if symbolic and not reason:     # export's own error would say only that a size specialised
        reason = ("its graphs are specialised per (batch, length), and this export marks a size "
                  "of its inputs dynamic; export it at static shapes (one program per length)")
    if reason:
        raise UnsupportedExportError(
            f"torch.export cannot trace {state._where()}: {reason}. {instead}.")
    try:
        return _converted_call(self, args, kwargs, ttt_state, return_ttt_state)
    except ConversionError:
        raise
    except Exception as e:          # export's tracing fails on an op of the plan
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UnsupportedExportError(
            f"torch.export could not trace {state._where()}: {type(e).__name__}"
            f"{f' ({first})' if first else ''}. {instead}.") from e


def _converted_call(self, args: tuple, kwargs: dict, ttt_state=None,
                    return_ttt_state: bool = False, flat: list | None = None):
    """The converted layer's call (``flat``: its inputs flattened): its code as written for
    meta tensors (``meta_call``), at a shape whose race kept it (``kept_call``), and while hooks
    are on its submodules or an attribute it was traced with changed (or a refusal), else its
    plan — inside a compiled graph when compiling
    — or a call carrying state. The hooks, the attributes and the weights are read in one
    walk of the layer's modules (``ModuleWalk``) where it finds them as converted; elsewhere
    each guard looks itself, and says what it found."""
    if flat is None:
        flat = _flat_inputs(args, kwargs)
    if on_meta({}, flat):    # shapes only: the code as written
        return meta_call(self, args, kwargs, stateful=ttt_state is not None or return_ttt_state)
    state = self._ttt2la
    stateful = ttt_state is not None or return_ttt_state
    if not stateful:
        out = state.kept_call(self, args, kwargs, flat)
        if out is not NOT_KEPT:
            return out
    walk = state.walk
    found = None if walk is None else walk.quiet(self)
    if found is None:
        if hooked(self):
            return state.hooked_call(self, args, kwargs, stateful=stateful)
        guard = state.attributes
        change = None if guard is None else guard.changed(self)
        if change is not None:
            return state.changed_call(self, args, kwargs, change, stateful=stateful)
    outside = state.outside
    change = None if outside is None else outside.changed()
    settings = state.settings       # one call and one comparison each, where the code reads them
    if change is None and settings is not None and settings.read() != settings.value:
        change = settings.changed()
    layout = state.input_layout
    if change is None and layout is not None and layout.key(flat) != layout.example:
        change = layout.changed(flat)
    autograd = state.autograd
    if change is None and autograd is not None:
        change = autograd.changed(self, flat)
    if change is not None:
        return state.changed_call(self, args, kwargs, change, stateful=stateful)
    weights = None if found is None else walk.weights(found)
    if weights is None:
        weights = params_and_buffers(self)
    now = weights_signature(weights)
    if now != state.weights and on_meta(weights, []):      # weights on meta, the inputs not
        return meta_call(self, args, kwargs, stateful=stateful)
    typed = state.typed_output      # ``torch.Size`` outputs, which the graphs make tuples
    if not stateful:
        if torch.compiler.is_compiling() and not kwargs \
                and all(isinstance(a, torch.Tensor) for a in args):
            out = _compiled_call(self, weights, args)
        else:
            out = state.for_weights(self, weights, now)(self, weights, args, kwargs, flat)
        return out if typed is None else typed(out)
    y, after = state.for_weights(self, weights, now).stateful_call(
        self, weights, args, kwargs, ttt_state)
    y = y if typed is None else typed(y)
    return (y, after) if return_ttt_state else y


@dataclass
class Recipe:
    """How a converted layer was built, to build it again where its compiled state cannot
    travel (pickling: the traced graphs hold fake tensors): the layer's path in its model,
    the level, backend and strictness, the folded constants of lossy passes
    (``{pass name: constants}``, replayed without calibration data) and the layer's example
    inputs as the conversion captured them, and where its loop stops gradients (found by the
    conversion's check, which is not run again)."""

    path: str
    level: int
    backend: str
    strict: bool
    folds: dict
    args: tuple
    kwargs: dict
    gradient_stop: str = ""
    partial_chunk: str = ""     # what zero padding of a partial last chunk changes
    undifferentiable: str = ""      # how the layer's own backward fails (``undifferentiable``)
    example_branch: str = ""    # how the code computes another function at the example's length
    cases: tuple = ()           # lines of decisions the plan makes itself (``chunking_decisions``)
    compiler: str | None = None     # the torch.compile backend its plan runs under, if any

    @classmethod
    def of(cls, rl, level: int, results, backend: str, strict: bool) -> "Recipe":
        folds = {r.name: r.folded for r in results if getattr(r, "folded", None)}
        return cls(rl.path, level, backend, strict, folds, tuple(rl.candidate.args),
                   dict(rl.candidate.kwargs))


def rebuild(cls: type, attributes: dict, recipe: Recipe, runs: dict, fallbacks: dict):
    """Unpickle a converted layer: the user's ``cls`` with its attributes (parameters,
    submodules), converted again from ``recipe`` — the same trace, passes and plan."""
    module = cls.__new__(cls)
    module.__setstate__(attributes)
    try:
        with as_found(module):              # traced as ``convert`` traced it
            state = _replay(module, recipe)
    except Exception as e:
        raise UnsupportedTTTError(
            f"the converted {cls.__name__}{f' at {recipe.path}' if recipe.path else ''} was "
            f"unpickled, and converting it again from its record failed ({type(e).__name__}: "
            f"{first_line(e)[:300]}). Save its weights instead "
            "(state_dict, or ttt2la.save) and load them into a conversion of the original model."
        ) from e
    state.runs, state.fallbacks = runs, fallbacks        # shared with the pickled report
    install(module, state)
    return module


def _replay(module: torch.nn.Module, recipe: Recipe) -> ConvertedState:
    from .conversion import _build_state           # conversion imports this module
    from .frontend.discover import discover
    from .frontend.recognize import recognize_layer
    from .passes import PassContext

    candidates = [c for c in discover(module, recipe.args, recipe.kwargs) if c.path == ""]
    if not candidates:
        raise UnsupportedTTTError(
            f"the converted layer {recipe.path or type(module).__name__} could not be rebuilt: "
            "its loop did not run on the example inputs recorded at conversion. Convert the "
            "original model again.")
    cand = dataclasses.replace(candidates[0], path=recipe.path)
    x = next((t for t in recipe.args if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    rl = recognize_layer(cand, None if x is None else x.shape[1])
    device = next((t.device for t in (*pytree.tree_leaves((recipe.args, recipe.kwargs)),
                                      *module.parameters()) if isinstance(t, torch.Tensor)),
                  None)
    state, _prepared, _analysis, _notes, exact = _build_state(
        rl, recipe.level, PassContext(folds=dict(recipe.folds)), recipe.backend, recipe.strict,
        device)
    state.recipe = recipe
    state.input_types = _input_types(state, _example_flat(state))
    state.as_written = AsWritten() if exact else None
    state.training_dependence = training_dependence(module, recipe.args, recipe.kwargs)
    state.gradient_stop = recipe.gradient_stop
    if recipe.partial_chunk:
        state.refuse_padding(recipe.partial_chunk)
    state.undifferentiable = recipe.undifferentiable
    if recipe.compiler:         # checked when converted: a failure now leaves it eager, said
        state.compiled = CompiledPlan(recipe.compiler)
    if recipe.cases:                    # found by the conversion's check, not run again
        from .chunking_decisions import drop_cases
        drop_cases(state, recipe.cases)
    if recipe.example_branch:           # the code as written runs at the example's length
        from .length_vouching import unvouch_example
        unvouch_example(state, rl, recipe.example_branch)
    return state


def _converted_reduce(self, protocol):
    """Pickle as the user's class plus a recipe: ``Converted<cls>`` is made at run time, so
    pickle cannot find it by name, and the compiled state holds fake tensors."""
    state = self._ttt2la
    if state.recipe is None:
        raise ConversionError(
            f"this converted {type(self).__name__} has no record of how it was converted, so "
            "it cannot be pickled; convert it with ttt2la.convert")
    if ORIGINAL not in type(self).__dict__:     # a class made on top of it (a parametrization's)
        raise ConversionError(
            f"this converted layer's class became {type(self).__name__} after conversion (a "
            "parametrization registered on its own weight), which pickle cannot store, as torch "
            "stores no parametrized module: save its state_dict and load it into the model "
            "parametrized the same way")
    attributes = {k: v for k, v in self.__dict__.items()
                  if k not in ("_ttt2la", "_ttt2la_key")}
    # the weights as they are now (cast or moved since conversion), the examples cast as they
    # were, so that loading converts the layer for the weights it holds
    now = weights_signature(params_and_buffers(self))
    recipe = state.recipe if now == state.weights or not state.weights else \
        recast_recipe(state.recipe, state.weights, now)
    return rebuild, (original_class(type(self)), attributes, recipe, state.runs,
                     state.fallbacks)


def _converted_deepcopy(self, memo):
    """A deep copy like any module's; the compiled state is shared (``ConvertedState``)."""
    new = type(self).__new__(type(self))
    memo[id(self)] = new
    new.__setstate__(copy.deepcopy(self.__dict__, memo))
    _register(new)
    return new


def _parameters(fn) -> tuple[str, ...]:
    """The names of ``fn``'s parameters (none where it has no signature to read)."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _converted_copy(self):
    """A shallow copy like any module's (sharing parameters and the compiled state)."""
    new = type(self).__new__(type(self))
    new.__setstate__(dict(self.__dict__))
    _register(new)
    return new


def converted_class(cls: type) -> type:
    """``Converted<cls>``: the user's class with ``forward`` running the converted program;
    it pickles as ``cls`` plus the recipe that converts it again."""
    new = _CLASSES.get(cls)
    if new is None:
        new = type(f"Converted{cls.__name__}", (cls,),
                   {"forward": forward_like(cls, _converted_forward),
                    "__module__": cls.__module__,
                    "__reduce_ex__": _converted_reduce, "__deepcopy__": _converted_deepcopy,
                    "__copy__": _converted_copy,
                    "__prepare_scriptable__": refuse_scripting,
                    ORIGINAL: cls,
                    "__doc__": f"{cls.__name__} whose TTT loop runs as linear attention "
                               "(converted by ttt2la)."})
        _CLASSES[cls] = new
    return new


def require_unconverted(model: torch.nn.Module) -> None:
    """Raise ``AlreadyConvertedError`` when ``model`` (or a submodule) is converted already."""
    if not isinstance(model, torch.nn.Module):
        return                  # not a module at all: convert says so itself
    done = [path or "the model itself" for path, m in model.named_modules() if is_converted(m)]
    if done:
        report = getattr(model, "ttt2la_report", None)
        level = f" at level {report.level}" if report is not None else ""
        raise AlreadyConvertedError(
            f"{type(model).__name__} is already converted{level} ({', '.join(done)} run as "
            "linear attention); ttt2la converts the original model. Convert the model you "
            "converted this one from (convert returns a copy and leaves it untouched), at the "
            "level you want now.")


def install(module: torch.nn.Module, state: ConvertedState) -> None:
    """Turn ``module`` into its converted class in place, keeping its parameters and names."""
    module.__class__ = converted_class(type(module))
    module._ttt2la = state
    code = LayerCode(module)            # read once for every guard below
    state.attributes = AttributeGuard.of(module, read_off_classes(module, code.names),
                                         state.caches)
    state.outside = GlobalGuard.of(module, code)
    state.settings = SettingsGuard.of(module, code)
    example = _example_flat(state)
    state.input_layout = LayoutGuard.of(module, example, code)
    state.autograd = AutogradGuard.of(module, code)
    state.input_types = _input_types(state, example)
    state.typed_output = typed_output(output_spec(getattr(state.outer, "gm", None)))
    state.walk = ModuleWalk.of(module, state.attributes)
    state.compile_break = compile_break(state)
    state.weights = weights_signature(params_and_buffers(module))
    _register(module)


#: Converted layers by key: a compiled graph names its layer by a key that TorchDynamo guards,
#: so a graph compiled for one layer never runs another (a closure per layer would not do:
#: Dynamo guards a function by its code, which every layer's closure shares).
_LAYERS: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _input_types(state: ConvertedState, example: list | None) -> InputTypes | None:
    """The dtypes and devices of ``example`` (the example call's inputs flattened), named as
    the call's signature names them (``None``: no record of them)."""
    if example is None:
        return None
    signature = getattr(state.layout, "signature", None)
    names = None if signature is None else [leaf.name for leaf in signature.leaves]
    return InputTypes.of(example, names)


def _example_flat(state: ConvertedState) -> list | None:
    """The example call's inputs flattened as a call's are (``None``: no record of them)."""
    recipe = state.recipe
    if recipe is None:
        return None
    args, kwargs = recipe.args, recipe.kwargs
    spelled = getattr(state.layout, "spelled", None)
    if spelled is not None:
        args, kwargs = spelled(args, kwargs)
    return _flat_inputs(args, kwargs)


def _register(module: torch.nn.Module) -> None:
    module._ttt2la_key = next(_KEYS)
    _LAYERS[module._ttt2la_key] = module


def _compiled_call(module: torch.nn.Module, weights: dict, args: tuple):
    """The converted layer's call as TorchDynamo traces it: what the eager call would run
    instead of the plan (``ConvertedState.route``: the code as written, traced like any code,
    or a refusal), else the plan — one call in the compiled graph, or between graphs where the
    plan cannot be traced or decides at run time (``compile_break``). The route is read off the
    state the layer was converted with: a state built again for cast weights (``recast``, a
    conversion, never traced) routes alike, the call's inputs compared with the example's cast
    as the weights were."""
    state = module._ttt2la
    instead = state.route(module, args, {}, list(args), weights_signature(weights))
    if instead is not None:
        return instead()
    reason = state.compile_break
    entry = _RUN_BETWEEN_GRAPHS[reason] if reason else _run_in_graph
    return entry(module._ttt2la_key, *weights.values(), *args)


def _call_parts(key: int, tensors: tuple) -> tuple:
    """The layer ``key``, its weights by name and its inputs, from a compiled graph's call of
    its parameters and buffers (in ``params_and_buffers`` order), then its positional tensor
    inputs."""
    layer = _LAYERS[key]
    pb = params_and_buffers(layer)
    n = len(pb)
    return layer, dict(zip(pb, tensors[:n])), tensors[n:]


def _run_converted(key: int, *tensors):
    """The converted layer ``key``'s plan on its weights and inputs (``_call_parts``), which
    the compiled graph takes (the eager call's ``route`` chose the plan as it was traced)."""
    layer, weights, inputs = _call_parts(key, tensors)
    flat = [t.contiguous() for t in inputs]
    state = layer._ttt2la.for_weights(layer, weights)
    B, L = state.layout.sizes(flat)
    # graphs are specialised per (B, L): a dynamic-shape compile specialises here too
    B, L = int(B), int(L)
    try:
        return state.outer_for(B, L).forward(weights, *flat)
    except Exception as e:
        if detect_fake_mode(flat) is not None:      # TorchDynamo tracing: run it eagerly
            _eagerly_instead(state, e, [weights, *flat], B, L)
        return state._plan_failed(e, layer, written_call(layer, tuple(inputs), {}), weights,
                                  flat, B, L)


def _eagerly_instead(state: ConvertedState, error: Exception, inputs: list, B: int, L: int):
    """A call the plan fails on while TorchDynamo traces it (on fake tensors), whose error
    TorchDynamo would replace by its own, naming no line: a graph break instead, so the call
    runs eagerly, where the eager call's error names the failing line and says whose it is
    (under ``fullgraph=True``, TorchDynamo's refusal names the line the fake run failed at,
    which a fake tensor's looser checks may put later than the real call's)."""
    from torch._dynamo.exc import unimplemented
    _, at, _ = failed_where(failing_node(state.outer_for(B, L), inputs),
                            str(state.program.loop_src), state.implementation)
    first = first_line(error)
    unimplemented(
        gb_type="ttt2la: a converted layer's plan fails on this call",
        context=f"{state._where()}, batch {state._batch(B)}, length {L}",
        explanation=f"traced on fake tensors, the converted {state.program.module_path or 'layer'}"
                    f" fails on this call {at} ({type(error).__name__}: {first}); it runs "
                    "eagerly instead, where the error names the line the call fails at and says "
                    "whether the layer as written fails too",
        hints=["Compile without fullgraph=True to run the call eagerly, or pass inputs the "
               "layer as written accepts (the dtype and device of its weights)."],
        from_exc=error)


def _run_call(call: Callable, *args):
    """``call(*args)``, run eagerly: what the wrappers below run between compiled graphs."""
    return call(*args)


#: A call the plan does not take, run as written: under ``torch.compile``, between compiled
#: graphs (a graph break) on the call's real tensors, its frames never compiled. Traced by
#: TorchDynamo on fake tensors, a failure of that code would escape as TorchDynamo's own error,
#: naming no line, instead of the eager call's ``RejectedCallError`` (eagerly the wrapper costs
#: under a microsecond).
_written_between_graphs = torch.compiler.disable(_run_call, reason=(
    "ttt2la: this call of a converted layer runs its code as written (a shape, mode or state "
    "its converted graphs do not take; see the layer's report runs). Compile it without "
    "fullgraph=True: the call then runs eagerly between the compiled graphs"))


#: A call with inputs of other dtypes or devices than the traced ones, run between compiled
#: graphs on its real tensors, so the code as written or the refusal decides as eagerly.
_other_types_between_graphs = torch.compiler.disable(_run_call, reason=(
    "ttt2la: this call of a converted layer passes an input in another dtype or on another "
    "device than the layer was traced with, so its converted graphs do not take it: it runs "
    "the code as written (an exact conversion) or is refused (a lossy one), and an eager call "
    "names the input. Pass inputs as the layer was traced with, or compile it without "
    "fullgraph=True: the call then runs eagerly between the compiled graphs"))


#: The converted layer as one call that ``torch.compile`` writes into its graph as it is
#: (``allow_in_graph``) instead of reading its Python: the layer specialises graphs from
#: templates and its plans walk torch.fx graphs, which TorchDynamo does not trace. The graph
#: compiler (AOTAutograd) then traces the call's tensor ops at the shape being compiled, so
#: ``torch.compile(converted, fullgraph=True)`` sees the whole layer as tensor ops.
_run_in_graph = torch.compiler.allow_in_graph(torch.compiler.disable(_run_converted))

#: A layer whose plan cannot be traced (``compile_break``) runs between compiled graphs, by
#: the reason it cannot be traced: ``torch.compile(..., fullgraph=True)`` refuses such a layer
#: with a message that carries the reason (``_between_graphs``).
_RUN_BETWEEN_GRAPHS: dict[str, Callable] = {}


def _run_eagerly(key: int, *tensors):
    """The converted layer ``key``'s eager call on its weights and inputs (``_call_parts``),
    run between compiled graphs: every decision the eager call makes, those only running the
    plan tells included (a partial chunk whose padding is not inert, a length the traces do
    not vouch for), is made on the call's own tensors."""
    layer, weights, inputs = _call_parts(key, tensors)
    return layer._ttt2la.for_weights(layer, weights)(layer, weights, tuple(inputs), {})


def _between_graphs(reason: str) -> Callable:
    """The converted layer as a call ``torch.compile`` runs between graphs, refused under
    ``fullgraph=True`` with ``reason`` (why it cannot be traced) and what to do instead."""
    if reason not in _RUN_BETWEEN_GRAPHS:
        _RUN_BETWEEN_GRAPHS[reason] = torch.compiler.disable(_run_eagerly, reason=(
            f"ttt2la: this converted layer cannot be traced into a compiled graph: {reason}. "
            "Compile it without fullgraph=True: it then runs eagerly between the compiled "
            "graphs"))
    return _RUN_BETWEEN_GRAPHS[reason]


def compile_break(state: ConvertedState) -> str:
    """Why ``torch.compile`` cannot trace the layer's plan into its graph ("" when it can):
    tensors held in the loop's graphs (the constants the lossy passes fold) are no inputs of
    the compiled graph, and forward-mode derivatives taken at run time do not trace. Such a
    layer runs between compiled graphs, as it runs eagerly."""
    reason = ""
    if any(n.op == "get_attr" for n in state.program.body.graph.nodes):
        reason = "its loop reads constants folded by the lossy passes"
    elif getattr(state.plan, "forward_ad", False):
        reason = "its plan takes an affine update's coefficients by forward-mode differentiation"
    elif state.length_vouching is not None:
        reason = ("its code computes Python values of the length, and each new length is "
                  "checked against the code as written (or refused) when it is called")
    elif state.program.partial_chunk:
        reason = ("zero padding of a partial last chunk changes "
                  f"{state.program.partial_chunk}, and a call with one runs the code as "
                  "written (or is refused) when the plan finds it")
    if reason:
        _between_graphs(reason)
    return reason


def is_converted(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "_ttt2la", None), ConvertedState)


__all__ = ["LoopModule", "ConvertedState", "Recipe", "install", "converted_class",
           "original_class", "is_converted", "require_unconverted", "rebuild"]
