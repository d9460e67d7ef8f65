"""A conversion sees the layer's evaluation-mode function; training mode is checked, not assumed.

A layer's code may compute differently in training mode — dropout draws a random mask, batch norm
normalises by the batch — and a trace records one mode's ops only. Converting a layer as it comes
(``nn.Module`` starts in training mode) would trace dropout's random mask, which no exact
rewrite can reproduce draw for draw. So ``convert`` and ``inspect`` trace and check every layer
in evaluation mode (``evaluating``), restoring each module's own flag afterwards, and
``training_dependence`` asks, on the example call, whether the layer computes the same in
training mode. Where it does not, a converted layer called in training mode does not run the
evaluation-mode graphs: an exact conversion runs the layer as written, a lossy one refuses
(``converted.ConvertedState``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch import nn

#: Modules known to compute differently in training mode, named when one is found.
MODE_DEPENDENT = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase)


@contextlib.contextmanager
def in_mode(*models: nn.Module, training: bool):
    """Every module of ``models`` in training (or evaluation) mode inside the block, each
    module's own ``training`` flag restored after it (a model may mix modes on purpose)."""
    saved = [(m, m.training) for model in models for m in model.modules()]
    try:
        for model in models:
            model.train(training)
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def evaluating(*models: nn.Module):
    """``in_mode(*models, training=False)``: how a conversion traces and checks."""
    return in_mode(*models, training=False)


def training_dependence(module: nn.Module, args: tuple, kwargs: dict) -> str:
    """``""`` when ``module`` computes the same on its example call in training and in
    evaluation mode (run once in each, eagerly, without gradients, the random generators and
    buffers left as they were), else what differs: its mode-dependent submodules, its own code,
    or a failure in training mode."""
    from .as_found import buffers_kept      # which builds on this module's ``evaluating``

    outputs = []
    try:
        # buffers_kept: batch norm's running statistics as they were
        with buffers_kept(module), torch.no_grad(), torch.random.fork_rng(devices=[]), \
                torch.compiler.set_stance("force_eager"):
            for training in (True, False):
                with in_mode(module, training=training):
                    outputs.append(pytree.tree_leaves(module(*args, **kwargs)))
    except Exception as e:                   # e.g. batch norm on a batch of one, in training
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"it fails on its example in training mode ({type(e).__name__}: {first})"
    same = len(outputs[0]) == len(outputs[1]) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        else a == b for a, b in zip(*outputs))
    if same:
        return ""
    named = [f"{name or type(module).__name__} ({type(m).__name__})"
             for name, m in module.named_modules() if isinstance(m, MODE_DEPENDENT)]
    if named:
        shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
        return f"its output differs in training mode, where {shown} act"
    return "its output differs in training mode (its own code reads `self.training`)"


__all__ = ["in_mode", "evaluating", "training_dependence", "MODE_DEPENDENT"]
