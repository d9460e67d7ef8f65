"""``ttt2la.convert`` and ``ttt2la.inspect``: the whole path from a user's model to a converted one.

    discover (eager pass) ─▶ recognize (trace small, roll up) ─▶ roles ─▶ passes (level)
        ─▶ associativity ─▶ lower ─▶ install on a copy of the model ─▶ check ─▶ report

Every conversion, lossy levels included, is checked numerically before it is returned: the
lowered plan against the rewritten program run by the recurrent executor on the example inputs
(the lowering is exact whatever the level). Exact conversions are also checked against the
original layer; lossy ones report the drift each applied pass causes. A failed check raises
instead of returning a wrong model.

With Newton–Schulz in fp32 or bf16 no tolerance is honest — the iteration amplifies rounding, the
user's code's as much as the plan's — so those checks judge each side's error against a float64
evaluation of the same function: the plan may be at most twice as far from it as the reference
(the recurrent executor, or the original layer) is, plus 1e-6.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.utils._pytree as pytree

from .analysis import analyze, assign_roles
from .analysis.op_vocabulary import fill_value
from .as_written import AsWritten
from .calibration import LoopCalibration, layer_inputs
from .call_variation import call_variation
from .compiled_plan import compile_plan, compiler_backend
from .converted import ConvertedState, Recipe, compile_break, install, require_unconverted
from .errors import (ChangedAttributeError, ConversionError, LevelNotImplementedError,
                     NonReducibleError, PartialChunkError, UnsupportedShapeError,
                     UnsupportedTTTError)
from .frontend.discover import discover, within
from .frontend.recognize import RecognizedLayer, _inputs_at, recognize_layer
from .frontend.shapes import fit_template
from .ir import LOOP_MODULE, SKIPPED_FIRST, TTTProgram
from .lowering import plan_for
from .lowering.check import check_plan, needs_float64_reference, recurrent_reference
from .passes import MAX_LEVEL, PassContext, PassResult, check_level, get_pass, run_passes
from .report import (KEPT_AS_WRITTEN, ConversionReport, InspectionReport, LayerReport, PassRecord,
                     StateRecord)
from .drift import first_output, layer_drift, lm_loss, model_with, other_outputs_differ, run_module
from .gradient_stops import detached_state, presence_difference, unseen_stop
from .chunking_decisions import cases_note, vouched_cases, without
from .length_vouching import example_branch, refuse_lossy_branch, unvouch_example, vouching
from .padded_chunk import padding_changes
from .undifferentiable import OwnBackwardFails
from .testing import rel_rms_error, tolerance
from .as_found import as_found, buffers_kept
from .training_mode import training_dependence
from .side_effects import written_while_converting
from .folded_weights import FoldedWeights, watch
from .validation import (InvalidInputError, as_level, check_argument_types, check_call,
                         check_finite, check_flag, check_folds_form, check_runs, copy_of)

_PROBE_LENGTHS = (64, 512, 4096)


# -- example inputs -------------------------------------------------------------------------

def _infer_example_inputs(model: torch.nn.Module, length: int) -> tuple:
    from .embedding import first_embedding

    emb = first_embedding(model)
    if emb is None:
        raise ConversionError(
            f"{type(model).__name__} does not start with an embedding, so ttt2la cannot guess "
            "its inputs: pass example_inputs=(x,) with a batch-first tensor whose second axis "
            "is the sequence, e.g. torch.randn(2, 256, d_model)")
    gen = torch.Generator().manual_seed(0)
    device = emb.weight.device
    return (torch.randint(0, emb.num_embeddings, (2, length), generator=gen).to(device),)


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def _seq_len(example_inputs: tuple) -> int | None:
    """The example's sequence length, its first input's axis 1; ``None`` for an image (four or
    more axes), whose axis 1 holds its channels."""
    x = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return None if x is None or x.dim() >= 4 else x.shape[1]


def _own_input_length(cand, seq_len: int | None) -> int | None:
    """``seq_len``, or where the model's input has no sequence (an image a stem turns into
    tokens, as vision backbones do), the length of the layer's own input: its axis 1."""
    if seq_len is not None:
        return seq_len
    x = next((t for t in pytree.tree_leaves((tuple(cand.args), dict(cand.kwargs)))
              if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return None if x is None else x.shape[1]


# -- recognition ----------------------------------------------------------------------------

def recognize(model: torch.nn.Module, example_inputs=None, *, example_kwargs=None):
    """Find and recognize every TTT loop of ``model``: ``(layers, example_inputs, notes)``."""
    from .embedding import first_embedding

    if example_inputs is None and example_kwargs and first_embedding(model) is None:
        example_inputs = ()                 # a call by keywords only: no ids to make up
    if example_inputs is None:
        lengths, inferred = _PROBE_LENGTHS, True
    else:
        lengths, inferred = (None,), False
    notes: list[str] = []
    for length in lengths:
        inputs = _infer_example_inputs(model, length) if inferred else _as_tuple(example_inputs)
        candidates = discover(model, inputs, example_kwargs)
        layers, failures, refusals = [], [], []
        for cand in candidates:
            try:
                layers.append(_recognized(cand, _own_input_length(cand, _seq_len(inputs))))
            except UnsupportedTTTError as e:
                failures.append((cand.path, f"{cand.path or '<model>'}: {e}"))
                refusals.append(e)
            except ConversionError:
                raise
            except Exception as e:          # a failure of ttt2la's own, not the layer's
                refusal = _unread(cand, e)
                failures.append((cand.path, f"{cand.path or '<model>'}: {refusal}"))
                refusals.append(refusal)
        layers, stepped = _without_stepped_callers(layers)
        failures += stepped
        if layers:
            notes += [f"not converted: {f}" for path, f in failures
                      if not any(within(path, layer.path) for layer in layers)]
            if inferred:
                notes.append(f"example inputs inferred: token ids of shape {tuple(inputs[0].shape)}")
            return layers, inputs, notes
        if not inferred:
            break
    if candidates:
        raise _refused(f"no test-time-training loop of {type(model).__name__} could be "
                       f"converted: {'; '.join(f for _, f in failures)}", refusals)
    raise UnsupportedTTTError(
        f"no test-time-training loop found in {type(model).__name__} (no module runs a Python "
        "loop). ttt2la converts layers whose forward (or a function it calls) loops over chunks "
        "or tokens, carrying fast weights updated from the sequence.")


def _without_stepped_callers(layers: list) -> tuple[list, list[tuple[str, str]]]:
    """``layers`` less each one recognized as a single step over its whole forward that holds
    another recognized layer (a model looping over its TTT blocks, whose loop takes no chunk):
    its step is theirs, and each block converts on its own. The dropped ones as failures."""
    kept, dropped = [], []
    for layer in layers:
        inner = [o.path for o in layers if o is not layer and o.path != layer.path
                 and within(o.path, layer.path)]
        if inner and layer.program.single_step:
            dropped.append((layer.path, f"{layer.path or '<model>'}: its forward runs the TTT "
                            f"layers {', '.join(inner)}, converted on their own"))
        else:
            kept.append(layer)
    return kept, dropped


def _recognized(cand, seq_len):
    """``cand`` recognized; where it is the caller of the module its loop runs in (which it
    hands numbers of the length) and cannot be, that module, as discovered."""
    try:
        return recognize_layer(cand, seq_len)
    except UnsupportedTTTError:
        if cand.callee is None:
            raise
    return recognize_layer(cand.callee, seq_len)


def _unread(cand, error: Exception) -> UnsupportedTTTError:
    """The refusal of a candidate whose reading failed inside ttt2la, with an error that is
    no refusal of its own: the layer is left as it is, the error named for a bug report."""
    return UnsupportedTTTError(
        f"ttt2la failed while reading the loop at {cand.loop.src} ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}); the layer is left as written. "
        "Please report this layer.")


def _refused(message: str, refusals: list[UnsupportedTTTError]) -> UnsupportedTTTError:
    """The error refusing every candidate: of the refusals' own class where they share one (a
    ``SideEffectError`` stays one, with what it names), else an ``UnsupportedTTTError``."""
    kinds = {type(e) for e in refusals}
    if len(kinds) != 1 or kinds == {UnsupportedTTTError}:
        return UnsupportedTTTError(message)
    error = kinds.pop()(message)
    error.__dict__.update(refusals[0].__dict__)
    return error


# -- one layer ------------------------------------------------------------------------------

@dataclass
class Prepared:
    """One layer after the passes of a level: the program, its results, its body template, and
    the three traced programs after every earlier step (for measuring each step's drift)."""

    program: TTTProgram
    results: list[PassResult]
    body: object                        # GraphTemplate
    steps: dict[int, list[TTTProgram]]  # step -> the three programs after steps 1..step


def _prepare(rl: RecognizedLayer, level: int, context: PassContext | None = None) -> Prepared:
    """Roles and passes on the three traced programs (folds measured on the first, replayed on
    the others), and the body template fitted from them."""
    context = context or PassContext()
    programs, results, steps = [], None, {}
    for rolled in (rl.rolled, rl.rolled_L, rl.rolled_B):
        prog = rolled.program.relabeled()         # run_passes rewrites a copy of its body
        prog.module_path = rl.path
        assign_roles(prog)
        prog, res, snaps = run_passes(prog, level, context, snapshots=True)
        programs.append(prog)
        results = results or res
        for snap in snaps:
            steps.setdefault(snap.step, []).append(snap.program)
    return Prepared(programs[0], results, _template(rl, programs), steps)


def _template(rl: RecognizedLayer, programs: list[TTTProgram]):
    return fit_template(programs[0].body, programs[1].body, programs[2].body,
                        B0=rl.B0, L0=rl.L0, L1=rl.L1, B1=rl.B1,
                        what=f"loop body of {rl.path or '<model>'} "
                             f"({type(rl.candidate.module).__name__})")


def _state_records(program: TTTProgram, analysis) -> list[StateRecord]:
    records = []
    for s, sa in zip(program.states, analysis.states):
        deps = ", ".join(f"{k}: {v.name.lower()}" for k, v in sa.depends_on.items())
        dependence = f"self: {sa.self_dependence.name.lower()}" + (f"; {deps}" if deps else "")
        records.append(StateRecord(s.name, s.role, sa.rule, f"{dependence} ({sa.mode})"))
    return records


def _stream_label(s) -> str:
    role = f" ({s.role})" if s.role and s.role != s.name else ""
    return f"{s.name}{role}{', per token' if s.per_token else ''}"


def _layer_report(rl, program, analysis, results, schedule, runtime, exact, notes,
                  levels=None, check=None, drifts=None) -> LayerReport:
    return LayerReport(
        module_path=rl.path, function=program.function, loop_src=str(program.loop_src),
        chunk_size=program.chunk_size, order=program.order, last_chunk=program.last_chunk,
        states=_state_records(program, analysis),
        streams=[_stream_label(s) for s in program.streams],
        passes=[PassRecord(r.step, r.name, r.status, r.exact, r.reason,
                           (drifts or {}).get(r.step), r.folded) for r in results],
        schedule=schedule, runtime=runtime, reducible=bool(analysis.reducible), exact=exact,
        notes=notes, levels=levels, check=check)




def _build_state(rl: RecognizedLayer, level: int, context: PassContext | None, backend: str,
                 strict: bool, device=None):
    """The converted layer's state, or ``None`` when the layer keeps the user's own code (a
    non-reducible loop with ``strict=False`` and no pass that changed its function: running
    the traced body recurrently would only be slower than the loop as written)."""
    prepared = _prepare(rl, level, context)
    state, analysis, notes, exact = _lower(rl, prepared.program, prepared.body, prepared.results,
                                           level, backend, strict, device)
    return state, prepared, analysis, notes, exact


def _lower(rl: RecognizedLayer, program: TTTProgram, body, results, level: int, backend: str,
           strict: bool, device=None):
    """Analyse a rewritten program and choose its plan: ``(state, analysis, notes, exact)``."""
    analysis = analyze(program)
    notes = list(rl.notes)
    exact = all(r.exact for r in results)
    schedule = None
    if not analysis.reducible:
        if strict:
            analysis.require_reducible(level)
        if exact:
            notes.append(f"not reducible at level {level}: {KEPT_AS_WRITTEN}, the user's own "
                         "code runs (strict=False)")
            return None, analysis, notes, exact
        schedule = "recurrent"
        notes.append(f"not reducible at level {level}: kept the recurrent executor "
                     "(strict=False)")
    used, zero_init = _program_indices(rl, program, *_loop_interface(rl))
    plan = plan_for(program, analysis, backend=backend, strict=strict, schedule=schedule,
                    used=used, zero_init=zero_init, device=device)
    interface = ([s.name for s in rl.program.states], [i.name for i in rl.program.invariants])
    state = ConvertedState(program=program, body=body, outer=rl.outer, layout=rl.layout,
                           plan=plan, interface=interface, strict=strict,
                           length_vouching=vouching(rl), skipped_first=_skipped_first(rl),
                           caches=rl.caches)
    if state.length_vouching is not None:
        notes.append(state.length_vouching.note(exact))
    return state, analysis, notes, exact


def _program_indices(rl: RecognizedLayer, program: TTTProgram, *index_sets: set[int]
                     ) -> list[set[int]]:
    """Indices of the recognized loop's states, as indices of the rewritten program's states
    (passes drop states — Θ, dead momentum — so positions shift; states are matched by name)."""
    names = [s.name for s in rl.program.states]
    position = {s.name: i for i, s in enumerate(program.states)}
    return [{position[names[i]] for i in indices if names[i] in position}
            for indices in index_sets]


def _loop_interface(rl: RecognizedLayer) -> tuple[set[int], set[int]]:
    """Which final states the code after the loop reads, and which states start at zero."""
    call = next(n for n in rl.outer.gm.graph.nodes
                if n.op == "call_module" and n.target == LOOP_MODULE)
    used = {u.args[1] - 1 for u in call.users if u.args[1] >= 1 and u.users}
    zero = {i for i, a in enumerate(call.args[: len(rl.program.states)])
            if fill_value(a) == 0.0}
    return used, zero


def _skipped_first(rl: RecognizedLayer) -> frozenset:
    """Names of the states whose use the loop's first iteration skips (they start at zero):
    the first iteration as written records no gradient through that use."""
    call = next(n for n in rl.outer.gm.graph.nodes
                if n.op == "call_module" and n.target == LOOP_MODULE)
    return frozenset(s.name for s, a in zip(rl.program.states, call.args)
                     if isinstance(a, torch.fx.Node) and a.meta.get(SKIPPED_FIRST))


def _layer_inputs(rl: RecognizedLayer):
    return tuple(rl.candidate.args), dict(rl.candidate.kwargs)


class _ExampleFault(ConversionError):
    """The plan fails on the example inputs, which the layer as written runs."""


def _on_the_example(converted: torch.nn.Module, rl: RecognizedLayer, args, kwargs):
    """The converted layer called on the example inputs, which the layer as written has just
    run: a plan that fails there is ttt2la's fault at any level, and said so (unless the code
    takes another branch at the example's length than at the probe lengths: ``_checked``)."""
    try:
        return converted(*args, **kwargs)
    except UnsupportedShapeError as e:
        why = getattr(e, "plan_fault", None)
        if why is None:
            raise
        raise _ExampleFault(
            f"the converted {rl.path or 'model'} ({rl.program.loop_src}) fails on the example "
            f"inputs, which the layer as written runs: {why}. This is a bug in ttt2la's "
            "lowering — please report it with the model; the original model is unchanged "
            "(ttt2la.convert leaves it untouched).") from e


def _check(ref: torch.Tensor, converted: torch.nn.Module, rl: RecognizedLayer, exact: bool,
           state) -> dict:
    """Compare the converted layer with the original's output ``ref`` on the example inputs.

    With Newton–Schulz below float64 no tolerance separates two correct evaluations, so an exact
    conversion is checked in two exact steps instead: the rewritten program, run by the
    recurrent executor in the layer (the user's ops in the user's order), against the original
    run eagerly (``_eagerly``) at the dtype's tolerance here, and the plan against that executor
    by ``_check_plan``.
    """
    args, kwargs = _layer_inputs(rl)
    with torch.no_grad():
        whole = _on_the_example(converted, rl, args, kwargs)
    got, ref_whole, ref = first_output(whole), ref, first_output(ref)
    if got.shape != ref.shape:
        raise ConversionError(
            f"the converted {rl.path or 'model'} ({rl.program.loop_src}) returns a "
            f"{tuple(got.shape)} output where the layer as written returns {tuple(ref.shape)} on "
            "the example inputs. This is a bug in ttt2la's lowering — please report it with the "
            "model; meanwhile convert with backend='naive' (the recurrent reference) or a lower "
            "level.")
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                 None)
    result = {"inputs": f"example, shape {tuple(first.shape) if first is not None else ()}",
              "rel_rms_error": rel_rms_error(got, ref)}
    if not exact:
        return result
    err = result["rel_rms_error"]
    if state is not None and needs_float64_reference(state.program, ref.dtype):
        with _as_traced(state, args, kwargs):
            err = rel_rms_error(run_module(converted, args, kwargs), ref)
        result["program_rel_rms_error"] = err
        result["judged"] = ("program_rel_rms_error (the loop as traced, run in the layer) "
                            "against the tolerance; the plan against that loop by the "
                            "precision criterion (lowering)")
    result["tolerance"] = tolerance(ref.dtype)
    result["ok"] = bool(err <= result["tolerance"])
    other = other_outputs_differ(whole, ref_whole, tensors=not needs_float64_reference(
        state.program, ref.dtype) if state is not None else True)
    if result["ok"] and other:
        result["ok"], result["outputs"] = False, other
    return result


@contextmanager
def _as_traced(state: ConvertedState, args: tuple, kwargs: dict):
    """Within the block the converted layer runs its rewritten loop as traced (the recurrent
    executor: the user's ops in the user's order) at the example's batch size, not its plan."""
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    loop = state.loop_for(state.layout.sizes(flat)[0])
    plan, loop.plan = loop.plan, recurrent_reference(loop.program)
    try:
        yield
    finally:
        loop.plan = plan
        state.runs.pop(loop.shape, None)      # not a run of the converted layer


def _gradient_stop(layer: "_Layer") -> str:
    """Where the layer's loop stops gradients its plan would pass (``gradient_stops``): a
    detach of the fast weights in the trace, or gradients of the loop run as traced that
    differ from the layer's own (``exact_twin``)."""
    if layer.state is None:
        return detached_state(layer.rl.program)
    found = detached_state(layer.state.program)     # after the passes: a detach they left dead
    if found:                                       # (a weight norm's target) stops nothing
        return found
    twin = layer.exact_twin
    if twin is None:
        return ""
    state, converted = twin
    args, kwargs = _plan_inputs(layer.rl, state)
    with _as_traced(state, args, kwargs):
        found = unseen_stop(layer.original, converted, args, kwargs)
    return found or (_presence_mismatch(layer) if layer.exact else "")


def _presence_mismatch(layer: "_Layer") -> str:
    """Where the plan's gradients leave None on a parameter or input the layer's own reach
    (with zeros, say) — at the example's length and at one and two chunks and a partial second
    one, where a momentum that starts at zero and an update nothing reads leave the most of the
    loop's arithmetic to skip; ``""`` where they agree. Optimizers treat None and zeros
    differently, so a mismatch is a stop (``presence_difference``)."""
    rl, state = layer.rl, layer.state
    args, kwargs = _plan_inputs(rl, state)
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    B, L = state.layout.sizes(flat)
    C = state.program.chunk_size
    runs = dict(state.runs)
    try:
        return _presence_at(layer, flat, B, L, sorted({int(L), C, C + 1, 2 * C}))
    finally:                    # the check's calls are no runs of the converted layer
        state.runs.clear()
        state.runs.update(runs)


def _presence_at(layer: "_Layer", flat: list, B: int, L: int, lengths: list) -> str:
    """``_presence_mismatch`` at each of ``lengths``."""
    rl, state = layer.rl, layer.state
    for length in lengths:
        at = pytree.tree_unflatten(
            _inputs_at(flat, state.layout, state.layout.batch_unit * B, length), rl.in_spec)
        try:
            with buffers_kept(layer.original), buffers_kept(rl.candidate.module):
                differ = presence_difference(layer.original, rl.candidate.module,
                                             tuple(at[0]), at[1])
        except Exception:
            if length == L:
                raise
            continue        # a length the layer or its conversion does not take: nothing to compare
        if differ:
            return (f"at length {length} the converted loop's gradients leave out tensors "
                    f"the layer's own reach: {differ}")
    return ""


def _padding(layer: "_Layer") -> str:
    """What zeros padded to a partial last chunk change in the layer (``padded_chunk``), judged
    on its exact twin (``exact_twin``)."""
    twin = None if layer.state is None else layer.exact_twin
    if twin is None:
        return ""
    state, converted = twin
    return padding_changes(layer.original, converted, state, *_plan_inputs(layer.rl, state),
                           _as_traced)


def _plan_inputs(rl: RecognizedLayer, state: ConvertedState) -> tuple[tuple, dict]:
    """The example inputs, or where the converted layer runs the code as written at the
    example's length (``_example_branch``), the same inputs at the first probe length, where it
    runs its plan (at the whole chunks below the example's length where the example's partial
    chunk runs as written, ``_padded_example``): the checks of the plan run there."""
    args, kwargs = _layer_inputs(rl)
    held = state.length_vouching
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    B, L = state.layout.sizes(flat)
    C = rl.program.chunk_size
    if state.program.partial_chunk and L % C:   # a partial chunk, which runs as written
        at = max(C, L - L % C)
    elif held is None or held.lengths.get(held.key(B, L)) is not False:
        return args, kwargs
    else:
        at = rl.L0
    args, kwargs = pytree.tree_unflatten(
        _inputs_at(flat, state.layout, state.layout.batch_unit * B, at), rl.in_spec)
    return tuple(args), kwargs


def _check_plan(rl: RecognizedLayer, state: ConvertedState) -> dict:
    """The lowered plan against the rewritten program run recurrently, on the loop's inputs at
    the example inputs (captured from the converted layer's own run)."""
    args, kwargs = _plan_inputs(rl, state)
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    B, _L = state.layout.sizes(flat)
    loop = state.loop_for(B)
    seen = []
    handle = loop.register_forward_pre_hook(lambda _m, a: seen.append(a))
    try:
        run_module(rl.candidate.module, args, kwargs)
    finally:
        handle.remove()
    _given, states0, invariants = loop.plan_inputs(seen[0])
    used, _zero = _loop_interface(rl)
    names = {rl.program.states[i].name for i in used}
    result = check_plan(loop.plan, loop.program, states0, invariants, names)
    result["plan"] = loop.plan.implementation
    if not result["ok"]:
        bad = {k: v for k, v in result.items() if isinstance(v, dict) and not v["ok"]}
        narrow = _narrow_state(state.program)
        if narrow:
            raise UnsupportedTTTError(
                f"{rl.path or 'the model'} ({state.program.loop_src}) keeps {narrow} between "
                f"iterations: the rounding after every step is part of the function it computes, "
                f"and a parallel plan, which never stores the state step by step, cannot repeat "
                f"it (its plan {loop.plan.implementation} differs by {bad}). Keep the state in "
                "the precision the loop computes in, or convert with backend='naive' to run the "
                "loop step by step, exactly.")
        overflow = _overflowing(invariants)
        if overflow:
            raise InvalidInputError(
                f"the lowered plan {loop.plan.implementation} of {rl.path or 'the model'} "
                f"({state.program.loop_src}) could not be checked on the example inputs: "
                f"{overflow}, so products of them overflow and the plan, which sums them in "
                f"another order than the loop, differs by {bad}. Pass example inputs scaled like "
                "the model's real inputs.")
        raise ConversionError(
            f"the lowered plan {loop.plan.implementation} of {rl.path or 'the model'} "
            f"({state.program.loop_src}) does not compute what the rewritten loop computes run "
            f"chunk by chunk ({result['criterion']}; failed: {bad}) on the example inputs. This "
            "is a bug in ttt2la's lowering — please report it with the model; meanwhile "
            "convert with backend='naive' (the recurrent reference) or a lower level.")
    return result


def _overflowing(tensors) -> str:
    """What in the loop's inputs is so large that a product of two overflows its dtype (empty
    when nothing is): a check failing there says nothing of the lowering."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            largest = float(t.detach().abs().max())
            limit = torch.finfo(t.dtype).max ** 0.5
            if largest > limit:
                return (f"the loop's inputs reach {largest:.3g} in {str(t.dtype)[6:]}, beyond "
                        f"{limit:.3g}")
    return ""


def _narrow_state(program) -> str:
    """``"state W in bfloat16 (at f.py:12), computing in float32"`` for a state the loop stores
    in a floating dtype narrower than its streams', else ``""``."""
    streams = [program.invariants[s.source].dtype for s in program.streams]
    wide = max((d for d in streams if d.is_floating_point), key=lambda d: torch.finfo(d).bits,
               default=None)
    for spec in program.states:
        if wide is not None and spec.dtype.is_floating_point and \
                torch.finfo(spec.dtype).bits < torch.finfo(wide).bits:
            where = f" (written at {spec.src})" if spec.src else ""
            return (f"state {spec.name} in {str(spec.dtype).replace('torch.', '')}{where}, "
                    f"computing in {str(wide).replace('torch.', '')},")
    return ""


def _device(module: torch.nn.Module, rl: RecognizedLayer):
    for t in (*pytree.tree_leaves(_layer_inputs(rl)), *module.parameters()):
        if isinstance(t, torch.Tensor):
            return t.device
    return None


# -- public API -----------------------------------------------------------------------------

@dataclass
class _Layer:
    """One layer while it is converted: what was recognized, built and measured."""

    rl: RecognizedLayer
    original: torch.nn.Module           # the layer before conversion
    device: object
    calibration: LoopCalibration
    prepared: Prepared
    state: ConvertedState | None
    analysis: object
    notes: list[str]
    exact: bool
    backend: str
    _at_step: dict = field(default_factory=dict)
    padding_recorded: bool = False      # what padding changes, kept already (``_record_padding``)

    @cached_property
    def exact_twin(self) -> "tuple[ConvertedState, torch.nn.Module] | None":
        """The layer converted exactly, for checks against the code as written: the converted
        layer itself when its conversion is exact, else a copy of the original converted at
        level 0 (None where level 0 does not convert); built once."""
        if self.exact:
            return self.state, self.rl.candidate.module
        try:
            state, *_ = _build_state(self.rl, 0, None, "torch", False, self.device)
        except ConversionError:
            return None
        if state is None:
            return None
        converted = copy.deepcopy(self.original)
        install(converted, state)
        state.autograd = None   # the checks differentiate it as traced, through leaf inputs
        return state, converted

    def state_at(self, step: int, unfolded: "Prepared | None" = None):
        """The converted state after steps 1..``step`` (of the unfolded run, if given); the
        last step's program is the prepared program itself, whose state is ``self.state``."""
        key = (step, unfolded is not None)
        if key not in self._at_step:
            prepared = unfolded or self.prepared
            if step in prepared.steps:
                programs = prepared.steps[step]
                program, body = programs[0], _template(self.rl, programs)
            elif unfolded is None:
                return self.state
            else:
                program, body = prepared.program, prepared.body
            self._at_step[key] = _lower(self.rl, program, body, prepared.results[:step], step,
                                        self.backend, False, self.device)[0]
        return self._at_step[key]


def _calibrations(target, layers, calibration, example_kwargs) -> list[LoopCalibration]:
    """Every layer's loop inputs on the calibration data (the example inputs when none)."""
    if calibration is None:
        return [LoopCalibration.capture(rl, *_layer_inputs(rl), "example") for rl in layers]
    seen = layer_inputs(target, [rl.candidate.module for rl in layers], _as_tuple(calibration),
                        example_kwargs)
    return [LoopCalibration.capture(rl, args, kwargs, "calibration")
            for rl, (args, kwargs) in zip(layers, seen)]


def _convert_layer(rl, calibration: LoopCalibration, level: int, folds: dict | None,
                   backend: str, strict: bool) -> _Layer:
    module = rl.candidate.module
    device = _device(module, rl)
    replay = dict((folds or {}).get(rl.path, {}))
    given = frozenset(replay)           # the context adds the folds it measures to ``replay``
    context = PassContext(calibration, replay)
    state, prepared, analysis, notes, exact = _build_state(rl, level, context, backend, strict,
                                                           device)
    if state is not None:
        state.recipe = Recipe.of(rl, level, prepared.results, backend, strict)
        state.folded_weights = FoldedWeights.of(module, rl.path, prepared.results, given)
    return _Layer(rl, copy.deepcopy(module), device, calibration, prepared, state, analysis,
                  notes, exact, backend)


def _step_drifts(layer: _Layer, level: int) -> dict[int, dict]:
    """Drift after every applied lossy step, with and without its fold, on calibration data."""
    cal = layer.calibration
    args, kwargs = cal.layer_args, cal.layer_kwargs
    ref = run_module(layer.original, args, kwargs)
    results = layer.prepared.results
    unfolded = None
    if any(r.folded for r in results):
        unfolded = _prepare(layer.rl, level, PassContext(cal, fold=False))
    drifts = {}
    for r in results:
        if r.exact or r.status != "applied":
            continue
        d = {"rel_rms_error": layer_drift(layer.original, layer.state_at(r.step), args, kwargs,
                                          ref)}
        if unfolded is not None and any(x.folded for x in results[:r.step]):
            d["unfolded_rel_rms_error"] = layer_drift(
                layer.original, layer.state_at(r.step, unfolded), args, kwargs, ref)
        d["inputs"] = cal.source
        drifts[r.step] = d
    return drifts


def _loss_drifts(pristine, layers: list[_Layer], inputs: tuple, drifts: list[dict]) -> dict | None:
    """For a language model: cross-entropy change after every lossy step (into ``drifts``) and
    of the converted model (returned)."""
    base = lm_loss(pristine, inputs)
    if base is None:
        return None
    steps = sorted({s for d in drifts for s in d})
    for step in steps:
        states = {layer.rl.path: layer.state_at(min(step, len(layer.prepared.results)))
                  for layer in layers}
        change = lm_loss(model_with(pristine, states), inputs) - base
        for d in drifts:
            if step in d:
                d[step]["loss_change"] = change
    final = lm_loss(model_with(pristine, {layer.rl.path: layer.state for layer in layers}),
                    inputs)
    return {"original": base, "converted": final, "change": final - base}


def convert(model: torch.nn.Module, level: int = 2, example_inputs=None, calibration=None,
            backend: str = "auto", strict: bool = True, inplace: bool = False,
            example_kwargs: dict | None = None, folds: dict | None = None,
            compile: bool | str | None = None) -> torch.nn.Module:
    """Rewrite every TTT loop of ``model`` by the paper's steps 1..``level`` and lower it.

    Returns a new module holding its own copy of the parameters under the original names (or
    ``model`` itself with ``inplace=True``); ``result.ttt2la_report`` says what was done.
    ``strict=True`` raises ``NonReducibleError`` when a loop is not reducible at ``level``;
    ``strict=False`` keeps such loops as written (after a lossy pass, the rewritten loop on the
    recurrent executor) and says so in the report.
    ``calibration`` (model inputs, like ``example_inputs``) is what lossy steps fold from and
    measure their drift on, and the example too when ``example_inputs`` is not given; ``folds``
    (``{layer path: {pass name: constants}}``, as a previous report recorded them) replays
    folds without calibration data. ``compile`` (``True`` or a ``torch.compile`` backend name)
    runs each converted layer's plan under ``torch.compile``, checked on the example inputs
    (``compiled_plan``); off by default: each new shape compiles first, and on a CPU inductor
    needs a C++ compiler.
    """
    require_unconverted(model)
    level = as_level(level)
    if example_inputs is None and calibration is not None:
        example_inputs = calibration                # model inputs as well: trace on them
    check_call(model, level, example_inputs, example_kwargs, backend, run=False)
    check_argument_types(calibration, None, "calibration")
    if calibration is not None:
        check_finite(calibration, None, "calibration")
    check_flag(strict, "strict")
    check_flag(inplace, "inplace")
    check_folds_form(folds)
    check_level(level)                      # a level whose steps are not all implemented
    compiler = compiler_backend(compile)
    pristine = copy_of(model) if inplace else model
    target = model if inplace else copy_of(model)
    with as_found(target, pristine), _eagerly():    # modes, buffers and generators restored
        try:
            return _convert(pristine, target, level, example_inputs, calibration, backend,
                            strict, example_kwargs, folds, compiler)
        except ChangedAttributeError as e:  # only the layer's own forward ran meanwhile
            raise written_while_converting(pristine, e) from None


def _eagerly():
    """Within the block the user's ``torch.compile``-decorated functions run as plain torch: the
    tracer reads their eager ops, so every check judges the conversion against those (a compiler
    rounds a bf16 Newton–Schulz differently, fusing its elementwise steps in fp32), and compiling
    the code as written only to compare with it would cost most of the conversion (30 of 41 s
    for LaCT's compiled operator at its published layout)."""
    return torch.compiler.set_stance("force_eager")


def _convert(pristine, target, level, example_inputs, calibration, backend, strict,
             example_kwargs, folds, compiler=None) -> torch.nn.Module:
    """``convert`` on ``target`` in evaluation mode (``training_mode``)."""
    check_runs(target, example_inputs, example_kwargs)
    layers, inputs, notes = recognize(target, example_inputs, example_kwargs=example_kwargs)
    _check_folds_name(folds, layers)
    modes = [training_dependence(rl.candidate.module, rl.candidate.args, rl.candidate.kwargs)
             for rl in layers]
    calibrations = _calibrations(target, layers, calibration, example_kwargs)
    built = [_convert_layer(rl, cal, level, folds, backend, strict)
             for rl, cal in zip(layers, calibrations)]
    _refuse_lossy_other_calls(built)
    # the checks below differentiate the plans through inputs that require grad: the guard
    # sending such calls to the code as written (``autograd_guard``) starts after them
    autograd = {}
    for layer, mode in zip(built, modes):
        if mode:
            layer.notes.append(f"converted for evaluation mode: {mode}; in training mode it "
                               + ("runs as written" if layer.exact else "refuses to run"))
        if layer.state is not None:
            layer.state.training_dependence = mode
            install(layer.rl.candidate.module, layer.state)
            if layer.state.folded_weights is not None:
                watch(layer.rl.candidate.module)
            autograd[id(layer)], layer.state.autograd = layer.state.autograd, None
    reports, drifts = [], []
    for layer in built:
        check = _checked(layer)
        _record_gradient_stop(layer)
        _record_padding(layer)
        drifts.append({} if layer.exact else _step_drifts(layer, level))
        reports.append((layer, check))
    loss = None
    if any(drifts):
        cal_inputs = _as_tuple(calibration) if calibration is not None else inputs
        loss = _loss_drifts(pristine, built, cal_inputs, drifts)
        if loss is not None:
            loss["inputs"] = "calibration" if calibration is not None else "example"
    if compiler is not None:    # before the races: its check runs the compiled plan
        for layer in built:
            if layer.state is not None:
                args, kwargs = _layer_inputs(layer.rl)
                layer.notes.append(compile_plan(layer.rl.candidate.module, layer.state, args,
                                                kwargs, compiler))
    layer_reports = [_finished_report(layer, check, d) for (layer, check), d in zip(reports, drifts)]
    for layer in built:     # after the checks above, which must see the plans
        if layer.state is None:
            continue
        layer.state.autograd = autograd[id(layer)]
        if layer.exact:
            layer.state.as_written = AsWritten()
    target.ttt2la_report = ConversionReport(level=level, layers=layer_reports, backend=backend,
                                            strict=strict, notes=notes, loss=loss)
    return target


def _refuse_lossy_other_calls(built: list) -> None:
    """A lossy layer that the model's example run also calls otherwise than the call it was
    converted from: the converted model would refuse its own example's later call (an exact
    layer runs the code as written there), so the conversion refuses, before installing."""
    for layer in built:
        others = getattr(layer.rl.layout, "other_calls", ())
        if layer.state is None or layer.exact or not others:
            continue
        rl = layer.rl
        raise UnsupportedShapeError(
            f"{rl.path or 'the model'} (the loop at {rl.program.loop_src}) is called "
            f"{len(others) + 1} ways in the model's example run, the later call(s) made "
            "otherwise than its first (another keyword, a state passed); a lossy conversion "
            "converts a layer's first call only, and does not run the code as written for "
            "others. Convert at an exact level (0–2), where such calls run the code as written, "
            "or call the layer one way.")


def _check_folds_name(folds: dict | None, layers: list[RecognizedLayer]) -> None:
    """Every layer and pass that ``folds`` names exists: an entry naming neither would be
    ignored, and the conversion would measure its constants again, not replay them."""
    paths = [rl.path for rl in layers]
    passes = [get_pass(step).name for step in range(1, MAX_LEVEL + 1)]
    for path, entry in (folds or {}).items():
        if path not in paths:
            raise InvalidInputError(
                f"folds names the layer {path!r}, and the model's TTT layers are "
                f"{', '.join(repr(p) if p else repr(p) + ' (the model itself)' for p in paths)}: "
                "give each layer's module_path from the report that recorded the folds.")
        unknown = [name for name in entry if name not in passes]
        if unknown:
            raise InvalidInputError(
                f"folds for {path!r} name {', '.join(map(repr, unknown))}, which is no pass; the "
                f"passes are {', '.join(passes)}.")


def _checked(layer: _Layer) -> dict:
    """The converted layer against the original on the example inputs, and its plan against the
    rewritten loop; raises when an exact conversion does not match."""
    rl, state = layer.rl, layer.state
    _vouch_cases(layer)
    args, kwargs = _layer_inputs(rl)
    with torch.no_grad():
        ref = layer.original(*args, **kwargs)       # all it returns (``_check``)
    if not layer.exact and state is not None:   # its check measures a drift: it cannot tell
        _refuse_lossy_branch(layer, ref)
    try:
        check = _check(ref, rl.candidate.module, rl, layer.exact, state)
    except PartialChunkError as e:      # the example's partial chunk, where padding is not inert
        if not layer.exact:
            raise
        check = _padded_example(layer, ref, e.what)
    except _ExampleFault:               # a size fitted at the probe lengths fails at this one
        check = (_example_branch(layer, ref) if layer.exact and state is not None else None)
        if check is None:
            raise
    if layer.exact and state is not None and not check.get("ok", True):
        check = _example_branch(layer, ref) or _padded_example(layer, ref) or check
    if state is not None:
        check["lowering"] = _check_plan(rl, state)
    if layer.exact and not check.get("ok", True):
        _refuse_variation(rl, layer.original)
        if "outputs" in check:
            raise ConversionError(
                f"the converted {rl.path or 'model'} returns {check['outputs']} on the example "
                "inputs although every applied pass is exact; this is a bug in ttt2la — please "
                "report it with the model. Use strict=False at a lower level meanwhile.")
        raise ConversionError(
            f"the converted {rl.path or 'model'} differs from the original by a relative "
            f"RMS error of {check['rel_rms_error']:.2e} on the example inputs although every "
            "applied pass is exact; this is a bug in ttt2la — please report it with the "
            "model. Use strict=False at a lower level meanwhile.")
    return check


def _vouch_cases(layer: _Layer) -> None:
    """Drop from the converted layer's vouching the decisions its plan makes itself
    (``chunking_decisions``), checked on its exact twin; the record keeps their lines for a
    layer built again from it."""
    state = layer.state
    held = state.length_vouching if state is not None else None
    if held is None or not any(v.chunking for v in held.found):
        return
    values = vouched_cases(held, layer.rl, layer.exact_twin, layer.original)
    if not values:
        return
    state.length_vouching = without(held, values)
    layer.notes[:] = [n for n in layer.notes if n != held.note(layer.exact)]
    layer.notes.append(cases_note(values))
    if state.length_vouching is not None:
        layer.notes.append(state.length_vouching.note(layer.exact))
    state.compile_break = compile_break(state)
    if state.recipe is not None:
        state.recipe.cases = tuple((v.file, v.line) for v in values)


def _refuse_variation(rl: RecognizedLayer, original: torch.nn.Module) -> None:
    """Refuse, naming the user's line, a layer whose code as written computes another function
    from one run to the next (random numbers) or with gradients on (``call_variation``): what
    fails the check is then the code, not the conversion."""
    why = call_variation(original, *_layer_inputs(rl))
    if why:
        raise UnsupportedTTTError(
            f"{rl.path or type(original).__name__} (the loop at {rl.program.loop_src}) cannot be "
            f"checked: {why}.")


def _refuse_lossy_branch(layer: _Layer, ref) -> None:
    """Refuse a lossy conversion whose code takes another Python branch at the example's length
    than at the probe lengths (``refuse_lossy_branch``). Its own check measures a drift, which
    cannot tell; the layer's exact twin, built from the same probe traces, can: where it is off
    the code as written at the example's length, the traces (``example_branch``) or the source
    (the vouching's lines) name the branch."""
    twin = layer.exact_twin
    if twin is None:
        return
    state, converted = twin
    try:
        agrees = _check(ref, converted, layer.rl, True, state)["ok"]
    except ConversionError:                 # another shape: another branch as well
        agrees = False
    if agrees:
        return
    held = layer.state.length_vouching
    why = example_branch(layer.rl) or (held.what if held is not None else "")
    if why:
        refuse_lossy_branch(layer.rl, [r.name for r in layer.prepared.results if not r.exact],
                            why)


def _example_branch(layer: _Layer, ref) -> dict | None:
    """The check again where the code around the loop computes another function at the
    example's length than at the probe lengths (``example_branch``; the lines the source shows
    computing Python values of the length, where the traces name none): the example's length is
    left to the code as written (``unvouch_example``), which the converted layer then runs
    there. ``None`` where neither explains the difference (the check's failure stands)."""
    rl, state = layer.rl, layer.state
    why = example_branch(rl)
    if not why and state.length_vouching is not None:
        why = state.length_vouching.what        # the lines the source shows
    if not why:
        return None
    layer.notes.append(unvouch_example(state, rl, why))
    state.compile_break = compile_break(state)
    if state.recipe is not None:
        state.recipe.example_branch = why
    return _checked_as_written(layer, ref)


def _checked_as_written(layer: _Layer, ref) -> dict:
    """``_check`` with the layer running the code as written where its plan does not take the
    call (``as_written`` is set only once every check is done)."""
    layer.state.as_written = AsWritten()
    try:
        return _check(ref, layer.rl.candidate.module, layer.rl, layer.exact, layer.state)
    finally:
        layer.state.as_written = None


def _padded_example(layer: _Layer, ref, found: str = "") -> dict | None:
    """The check again where the example's last chunk is partial and zero padding changes the
    layer (``found``, where the plan said so, else ``_record_padding``'s verdict: a maximum over
    the chunk, which a first-order probe of the padding does not see): calls with a partial
    chunk, the example's included, run the code as written. ``None`` where padding changes
    nothing (the check's failure stands)."""
    rl, state = layer.rl, layer.state
    args, kwargs = _layer_inputs(rl)
    flat, _ = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if state.layout.sizes(flat)[1] % rl.program.chunk_size == 0 \
            or not _record_padding(layer, found):
        return None
    return _checked_as_written(layer, ref)


def _record_padding(layer: _Layer, found: str = "") -> bool:
    """Keep what zero padding of a partial last chunk changes (``found``, else ``_padding``'s
    verdict) on the layer's program, its plans and its recipe, so calls with a partial chunk run
    as written (exact conversions) or are refused (lossy ones), and say so in the report;
    whether it changes anything."""
    if layer.padding_recorded:
        return True
    found = found or _padding(layer)
    if not found:
        return False
    layer.padding_recorded = True
    layer.state.refuse_padding(found)
    if layer.state.recipe is not None:
        layer.state.recipe.partial_chunk = found
    layer.notes.append(f"partial last chunk: zero padding changes {found}; calls with one "
                       + ("run as written" if layer.exact else "are refused"))
    return True


def _record_gradient_stop(layer: _Layer) -> None:
    """Keep where the layer's loop stops gradients on its state and recipe, and say in the
    report what calls recording gradients do; for a layer whose own backward fails, that its
    converted form refuses the backward too (``undifferentiable``)."""
    try:
        stop = "" if layer.state is None else _gradient_stop(layer)
    except OwnBackwardFails as e:
        layer.state.undifferentiable = str(e)
        if layer.state.recipe is not None:
            layer.state.recipe.undifferentiable = str(e)
        layer.notes.append(f"gradients: not checked: the layer as written cannot be "
                           f"differentiated ({e}); the converted layer refuses the backward "
                           "too")
        return
    if not stop:
        return
    layer.state.gradient_stop = stop
    if layer.state.recipe is not None:
        layer.state.recipe.gradient_stop = stop
    layer.notes.append(f"gradients: {stop}; calls that record gradients "
                       + ("run as written" if layer.exact else "are refused"))


def _finished_report(layer: _Layer, check: dict, drifts: dict) -> LayerReport:
    state = layer.state
    if state is None:
        schedule, runtime, runs, fallbacks = "recurrent", KEPT_AS_WRITTEN, {}, {}
    else:
        schedule, runtime = state.schedule, check["lowering"]["plan"]
        runs, fallbacks = state.runs, state.fallbacks
    report = _layer_report(layer.rl, layer.prepared.program, layer.analysis,
                           layer.prepared.results, schedule, runtime, layer.exact, layer.notes,
                           check=check, drifts=drifts)
    report.runs, report.fallbacks = runs, fallbacks       # live: filled as shapes run
    return report


def _level_verdict(rl: RecognizedLayer, level: int) -> str:
    try:
        check_level(level)
    except LevelNotImplementedError:
        return "not implemented"
    try:
        program = _prepare(rl, level).program
    except ConversionError as e:
        return f"unsupported: {e}"
    analysis = analyze(program)
    if analysis.reducible:
        return analysis.schedule
    try:
        analysis.require_reducible(level)
    except NonReducibleError as e:
        if not e.op:
            return "recurrent"
        return f"recurrent: {e.op}" + (f" at {e.where}" if e.where else "")
    return "recurrent"


def inspect(model: torch.nn.Module, example_inputs=None, example_kwargs=None, *,
            show: bool = True) -> InspectionReport:
    """Find the TTT loops of ``model`` and say what each level 0–6 would make of them.

    Prints the report (``show=False`` to only return it); ``model`` is not modified.
    """
    require_unconverted(model)
    with as_found(model):
        check_call(model, example_inputs=example_inputs, example_kwargs=example_kwargs)
        layers, _inputs, notes = recognize(model, example_inputs, example_kwargs=example_kwargs)
    reports = []
    for rl in layers:
        program = rl.program.clone()
        program.module_path = rl.path
        assign_roles(program)
        analysis = analyze(program)
        levels = {k: _level_verdict(rl, k) for k in range(MAX_LEVEL + 1)}
        reports.append(_layer_report(rl, program, analysis, [], analysis.schedule
                                     if analysis.reducible else "recurrent", "-",
                                     analysis.reducible, list(rl.notes), levels=levels))
    report = InspectionReport(layers=reports, notes=notes)
    if show:
        from rich.console import Console

        Console().print(report)
    return report


__all__ = ["convert", "inspect", "recognize"]
