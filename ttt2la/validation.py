"""Checks of what a caller hands ``convert``, ``inspect`` and the command line, made before any
work starts so that a bad argument is answered in one line instead of crashing deep inside a
trace (or after a long conversion)."""
from __future__ import annotations

import copy
import operator
import os
import tempfile
import traceback

from pathlib import Path

import torch
import torch.utils._pytree as pytree

from .errors import ConversionError

MAX_LEVEL = 6
BACKENDS = ("auto", "torch", "triton", "naive")


class InvalidInputError(ConversionError, ValueError):
    """An argument cannot be worked on: not a module, a level or backend that does not exist,
    example inputs the model fails on or that are not finite, an output path that cannot be
    written."""


def check_call(model, level=None, example_inputs=None, example_kwargs=None, backend=None, *,
               run: bool = True) -> None:
    """Everything ``convert`` (with ``level`` and ``backend``) or ``inspect`` (without) needs of
    its arguments: a module, a level 0–6, a known backend, finite non-empty example inputs and — with
    ``run`` — a model that runs on them (see ``check_runs``)."""
    check_model(model)
    if level is not None or backend is not None:
        check_level(level)
        check_backend(backend)
    check_argument_types(example_inputs, example_kwargs)
    check_materialized(model, example_inputs, example_kwargs)
    if level is not None:
        check_finite_weights(model)
    if example_inputs is not None or example_kwargs:
        check_finite(example_inputs, example_kwargs)
        if run:
            check_runs(model, example_inputs, example_kwargs)


def check_model(model) -> None:
    """A ``torch.nn.Module`` written in Python: a TorchScript model (``torch.jit.script`` or
    ``trace``) is a compiled graph, not the Python code ttt2la traces."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got "
                                f"{'None' if model is None else type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise InvalidInputError(
            f"the model is a TorchScript module ({type(model).__name__}), a compiled graph "
            "rather than the Python code ttt2la traces: convert the Python module it was "
            "scripted or traced from")


def copy_of(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` (ttt2la converts a copy and leaves the user's model alone), or an
    error saying why the model cannot be copied and what to do."""
    try:
        return copy.deepcopy(model)
    except Exception as e:
        raise InvalidInputError(
            f"{type(model).__name__} cannot be copied ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}), and ttt2la works on a copy of the "
            "model, leaving it untouched. torch.nn.utils.weight_norm, spectral_norm and prune "
            "keep a weight computed by a hook, which cannot be copied: use the "
            "torch.nn.utils.parametrizations forms instead, or remove them before converting "
            "(torch.nn.utils.remove_weight_norm, prune.remove).") from e


def as_level(level) -> int:
    """``level`` as a plain int: an int or any integer a user may hold (``numpy.int64``, a
    one-element integer tensor), checked to run from 0 to ``MAX_LEVEL``; a bool or a float is
    refused."""
    try:
        value = level if isinstance(level, bool) else operator.index(level)
    except TypeError:
        value = level
    check_level(value)
    return value


def check_level(level) -> None:
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
        raise InvalidInputError(f"level must be an integer from 0 to {MAX_LEVEL} (the paper's "
                                f"steps applied), got {level!r}")


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got "
                                f"{backend!r}")


def check_argument_types(example_inputs, example_kwargs, name: str = "example_inputs") -> None:
    """``example_inputs`` (or the argument ``name``): a tensor, a tuple or list of positional
    arguments, or None; ``example_kwargs``: a dict of keyword arguments, or None."""
    if example_inputs is not None and not isinstance(example_inputs, (torch.Tensor, tuple, list)):
        hint = " (pass keyword arguments as example_kwargs)" if isinstance(example_inputs, dict) \
            else ""
        raise InvalidInputError(
            f"{name} must be a tensor or a tuple of the model's positional arguments, "
            f"got {type(example_inputs).__name__}{hint}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise InvalidInputError(f"example_kwargs must be a dict of the model's keyword "
                                f"arguments, got {type(example_kwargs).__name__}")


def check_flag(value, name: str) -> None:
    """A switch such as ``strict`` or ``inplace``: True or False, not a value that happens to be
    truthy (``strict="False"`` would otherwise mean strict)."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")


def check_folds_form(folds) -> None:
    """``folds``: None or ``{layer path: {pass name: constants}}`` as a report records them."""
    if folds is None:
        return
    if not isinstance(folds, dict) or not all(
            isinstance(path, str) and isinstance(entry, dict) and all(isinstance(k, str) for k in entry)
            for path, entry in folds.items()):
        raise InvalidInputError(
            "folds must be {layer path: {pass name: constants}}, as a conversion report records "
            "them (each layer's module_path: {its pass's name: its folded}), got "
            f"{_form(folds)}")


def _form(value) -> str:
    if isinstance(value, dict):
        inner = next(iter(value.items()), None)
        return "an empty dict" if inner is None else \
            f"a dict of {type(inner[0]).__name__} to {type(inner[1]).__name__}"
    return type(value).__name__


def _arguments(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else \
        tuple(example_inputs if example_inputs is not None else ())
    return args, dict(example_kwargs or {})


def check_materialized(model: torch.nn.Module, example_inputs, example_kwargs=None) -> None:
    """Refuse weights or example inputs on the meta device: they have shapes but no values, and
    a conversion runs the model on its example and compares values."""
    args, kwargs = _arguments(example_inputs, example_kwargs)
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    meta = [f"example input {input_name(path)}" for path, leaf in leaves
            if isinstance(leaf, torch.Tensor) and leaf.is_meta]
    meta += [f"{type(model).__name__}.{name}" for name, t in
             [*model.named_parameters(), *model.named_buffers()] if t.is_meta][:3]
    if meta:
        raise InvalidInputError(
            f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (a shape "
            "without values); ttt2la runs the model on its example inputs and compares values: "
            "materialize the weights first (model.to_empty(device='cpu'), then load them) and "
            "pass real tensors")


def check_finite(example_inputs, example_kwargs=None, what: str = "example") -> None:
    """Refuse example (or, ``what``, calibration) inputs that are not dense tensors, hold NaN or
    inf, or have an empty axis: the conversion traces the model on them and is checked on them."""
    args, kwargs = _arguments(example_inputs, example_kwargs)
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.layout != torch.strided:
            raise InvalidInputError(
                f"{what} input {input_name(path)} is a {str(leaf.layout).replace('torch.', '')} "
                "tensor; ttt2la traces and checks the model on dense tensors: pass it dense "
                "(.to_dense())")
        if leaf.numel() == 0 and leaf.dim() > 0:
            raise InvalidInputError(
                f"{what} input {input_name(path)} has shape {tuple(leaf.shape)}, an empty axis; "
                f"ttt2la runs the model on its {what} inputs, which needs at least one "
                "sequence of at least one token: pass a sequence of a few chunks")
        if leaf.is_floating_point() and not bool(torch.isfinite(leaf).all()):
            bad = int((~torch.isfinite(leaf)).sum())
            raise InvalidInputError(
                f"{what} input {input_name(path)} holds {bad} NaN or infinite value(s); ttt2la "
                f"compares the converted model with the original on the {what} inputs, which "
                "needs finite values")


def check_finite_weights(model: torch.nn.Module) -> None:
    """Refuse a model whose floating-point parameters hold NaN or inf, or whose buffers hold
    NaN (a diverged training run; an infinite buffer is a mask): the conversion is checked
    against the original's outputs, which would be NaN too, and the failed check would
    otherwise read as a bug in the lowering."""
    def bad_values(t: torch.Tensor, finite: bool) -> int:
        if not t.is_floating_point() or t.is_meta:
            return 0
        return int((~torch.isfinite(t) if finite else torch.isnan(t)).sum())
    bad = [(name, n) for tensors, finite in ((model.named_parameters(), True),
                                             (model.named_buffers(), False))
           for name, t in tensors if (n := bad_values(t, finite))]
    if bad:
        named = ", ".join(f"{type(model).__name__}.{name} ({n})" for name, n in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise InvalidInputError(
            f"the model's weights hold NaN or infinite values: {named}{more}; ttt2la compares "
            "the converted model with the original, which needs finite weights. Load weights "
            "from before training diverged, or repair these tensors")


def check_runs(model: torch.nn.Module, example_inputs, example_kwargs=None) -> None:
    """Refuse example inputs the model itself fails on: one eager forward pass without
    gradients (compiled code run eagerly), so the model's own error is shown, not a trace's.
    ``convert`` calls it on its copy of the model, so the caller's model is not run."""
    if example_inputs is None and not example_kwargs:
        return
    args, kwargs = _arguments(example_inputs, example_kwargs)
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(*args, **kwargs)
    except Exception as e:
        leaves = pytree.tree_leaves((args, kwargs))
        shapes = ", ".join(_describe(t) for t in leaves[:8]) + \
            (f" and {len(leaves) - 8} more" if len(leaves) > 8 else "")
        raise InvalidInputError(
            f"{type(model).__name__} fails on the example inputs ({shapes}){_where(e)}: "
            f"{type(e).__name__}: "
            f"{str(e).strip().splitlines()[0].rstrip('.') if str(e).strip() else ''}"
            + (NEEDS_GRAD_MODE if needs_grad_mode(e) or _runs_with_gradients(model, args, kwargs)
               else " — pass inputs the model accepts (dtype, width, token ids below the "
               "vocabulary size)")) from e


def _runs_with_gradients(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``model``, which failed without gradients, runs while they are recorded: then
    its inputs are fine and its code needs gradient mode."""
    try:
        with torch.enable_grad(), torch.compiler.set_stance("force_eager"):
            model(*args, **kwargs)
    except Exception:
        return False
    return True


#: What to do when a layer's inner gradient works only while the caller records gradients.
NEEDS_GRAD_MODE = (
    ". The model runs here without gradients, as inference under torch.no_grad() does, and its "
    "torch.autograd.grad then finds nothing that requires grad: take the inner gradient under "
    "torch.enable_grad() with requires_grad_() on the fast weight, or with torch.func.grad, so "
    "the layer runs in either mode")


def needs_grad_mode(e: BaseException) -> bool:
    """Whether ``e`` is autograd's error for a gradient of something that records none."""
    return isinstance(e, RuntimeError) and "does not require grad" in str(e)


def input_name(path, whole: str = "?") -> str:
    """``#0`` for the first positional input of ``(args, kwargs)``, ``'mask'`` for a keyword
    one (a pytree key path); ``whole`` for a path that names no single input."""
    keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
    if len(keys) < 2:
        return whole
    return (f"#{keys[1]}" if keys[0] == 0 else repr(keys[1])) + \
        "".join(f".{k.name}" if isinstance(k, pytree.GetAttrKey) else f"[{k!r}]"
                for k in keys[2:])


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}".replace("torch.", "")
    return type(t).__name__


def _where(e: BaseException) -> str:
    """`` at file:line`` of the innermost frame outside torch, where the model's code failed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename and
              f"{os.sep}ttt2la{os.sep}validation" not in f.filename]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def check_writable(path, what: str) -> Path:
    """Check that ``path`` can be created (``what`` names the option, e.g. ``--json``) before
    any work is done: its folder exists and accepts new files, and it is not a folder itself.
    Probed by creating and removing a temporary file, so permissions are judged as the system
    judges them, not guessed."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InvalidInputError(f"{what} {path}: is a directory")
    if not parent.is_dir():
        raise InvalidInputError(f"{what} {path}: the folder {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InvalidInputError(f"{what} {path}: cannot write in {parent} "
                                f"({e.strerror or e})") from e
    if path.exists() and not os.access(path, os.W_OK):
        raise InvalidInputError(f"{what} {path}: the file exists and is read-only")
    return path


__all__ = ["InvalidInputError", "check_call", "check_model", "check_level", "check_backend",
           "check_argument_types", "check_materialized", "check_finite", "check_finite_weights",
           "check_runs",
           "check_writable"]
