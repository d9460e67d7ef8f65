"""Drift: how far a lossy step moves a layer (and a language model) from the original function.

Measured on calibration data (the example inputs when none were given), after every step of one
run of the passes: the relative RMS error of each converted layer's output against the original
layer's, and for a model with a language-model head the change in next-token cross-entropy.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from .converted import install
from .testing import rel_rms_error, same_value


def first_output(out):
    """A layer's (or model's) main output: itself, or the first tensor of a tuple/pytree."""
    return out if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)[0]


def other_outputs_differ(got, want, tensors: bool = True) -> str:
    """What differs between two outputs of a layer besides the first tensor, in words (``""``
    where nothing does): their structure, a Python value it returns (a flag, a count), or, with
    ``tensors``, another tensor beyond its dtype's tolerance. A value the converted graphs hold
    as a constant passed every check that compared the main output alone."""
    xs, spec_got = pytree.tree_flatten(got)
    ys, spec_want = pytree.tree_flatten(want)
    if spec_got != spec_want:
        return f"an output of another structure ({spec_got} where the layer as written " \
            f"returns {spec_want})"
    main = next((i for i, y in enumerate(ys) if isinstance(y, torch.Tensor)), -1)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i == main:
            continue
        tensor = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        if (tensors or not tensor) and not (same_value(x, y) and type(x) is type(y)):
            return f"another tensor as its output value #{i} than the layer as written" \
                if tensor else f"{x!r} as its output value #{i} where the layer as written " \
                f"returns {y!r}"
    return ""


def run_module(module: torch.nn.Module, args: tuple, kwargs: dict | None = None):
    with torch.no_grad():
        return first_output(module(*args, **(kwargs or {})))


def layer_drift(original: torch.nn.Module, state, args: tuple, kwargs: dict,
                reference: torch.Tensor) -> float:
    """Relative RMS error of ``original`` converted with ``state`` against ``reference`` (the
    original's output on the same inputs); ``state=None`` keeps the user's code (no drift)."""
    if state is None:
        return 0.0
    probe = copy.deepcopy(original)
    install(probe, copy.deepcopy(state))     # the state's guards are the converted layer's
    return rel_rms_error(run_module(probe, args, kwargs), reference)


def vocabulary_size(model: torch.nn.Module) -> int | None:
    """The number of token ids the model's first embedding takes, or ``None``."""
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if emb is None else emb.num_embeddings


def lm_loss(model: torch.nn.Module, inputs: tuple) -> float | None:
    """Mean next-token cross-entropy (nats) of ``model`` on token ids ``inputs[0]``, or ``None``
    when the model is not a language model (integer ids in, logits over its vocabulary out)."""
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].is_floating_point() \
            or inputs[0].dim() != 2 or inputs[0].shape[1] < 2:
        return None
    vocab = vocabulary_size(model)
    logits = run_module(model, inputs)
    if vocab is None or logits.dim() != 3 or logits.shape[-1] != vocab \
            or logits.shape[:2] != inputs[0].shape:
        return None
    ids = inputs[0]
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(),
                                 ids[:, 1:].reshape(-1)))


def model_with(model: torch.nn.Module, states: dict[str, object]) -> torch.nn.Module:
    """A copy of ``model`` whose layers at the given paths run the given converted states."""
    probe = copy.deepcopy(model)
    for path, state in states.items():
        if state is not None:
            install(probe.get_submodule(path) if path else probe, state)
    return probe


__all__ = ["first_output", "run_module", "layer_drift", "lm_loss", "model_with",
           "vocabulary_size"]
