"""A conversion sees the layer's evaluation-mode function; training mode is checked, not assumed.

A layer's code may compute differently in training mode — dropout draws a random mask, batch norm
normalises by the batch — and a trace records one mode's ops only. Converting a layer as it comes
(``nn.Module`` starts in training mode) would trace dropout's random mask, which no exact
rewrite can reproduce draw for draw. So ``convert`` and ``inspect`` trace and check every layer
in evaluation mode (``evaluating``), restoring each module's own flag afterwards, and
``training_dependence`` asks, on the example call, whether the layer computes the same in
training mode — its outputs, and where they agree the gradients of each, which a stop taken only
while training (``if self.training: W = W.detach()``, on the output or on a returned state)
changes alone. Where it does not, a converted layer called in training mode does not run the
evaluation-mode graphs: an exact conversion runs the layer as written, a lossy one refuses
(``converted.ConvertedState``).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re

import torch
import torch.utils._pytree as pytree
from torch import nn

from .original_class import original_class

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
    evaluation mode, else what differs and where: its mode-dependent submodules, its own code,
    or a failure in training mode. The outputs are compared first (run once in each mode,
    without gradients); where they agree, so must the gradients of a fixed random projection of
    each floating output with respect to the parameters and floating inputs — a layer may stop
    gradients only while training (``if self.training: W = W.detach()``, on a returned state
    alone too), which the evaluation-mode graphs would let through. Every run starts from the
    same random generator state, and the generators and buffers are left as they were."""
    from .as_found import buffers_kept      # which builds on this module's ``evaluating``

    # buffers_kept: batch norm's running statistics as they were
    with buffers_kept(module), torch.random.fork_rng(devices=[]), \
            torch.compiler.set_stance("force_eager"):
        rng = torch.get_rng_state()

        def run(probe, training):
            """``probe`` with the modules of ``training`` (all, when ``True``) in training mode
            and the rest in evaluation mode, from the same generator state."""
            with in_mode(module, training=training is True):
                for m in () if isinstance(training, bool) else training:
                    m.training = True
                torch.set_rng_state(rng)
                return probe(module, args, kwargs)

        try:
            in_training = run(_outputs, True)
        except Exception as e:               # e.g. batch norm on a batch of one, in training
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return f"it fails on its example in training mode ({type(e).__name__}: {first})"
        evaluated = run(_outputs, False)
        if not _same_outputs(in_training, evaluated):
            probe, same, what = _outputs, _same_outputs, "its output differs in training mode"
        else:
            evaluated = run(_gradients, False)
            if _same_gradients(run(_gradients, True), evaluated):
                return ""
            probe, same, what = _gradients, _same_gradients, \
                "its gradients differ in training mode (its output does not)"
        # which part acts: each mode-dependent submodule alone in training mode, then the rest
        dependent = [(name, m) for name, m in module.named_modules()
                     if isinstance(m, MODE_DEPENDENT)]
        named = {m: f"{name or type(module).__name__} ({type(m).__name__})"
                 for name, m in dependent}

        def acts(modules: list) -> bool:
            try:
                return not same(run(probe, modules), evaluated)
            except Exception:                # fails with only these in training mode
                return True

        acting = [m for _, m in dependent if acts([m])]
        others = [m for m in module.modules() if not isinstance(m, MODE_DEPENDENT)]
        own = bool(others) and acts(others)
    if not acting and not own:              # only together: name them all
        acting, own = [m for _, m in dependent], not dependent
    parts = []
    if acting:
        parts.append("where " + ", ".join(named[m] for m in acting[:3])
                     + (f" and {len(acting) - 3} more" if len(acting) > 3 else "") + " act")
    if own:
        parts.append(_reads_training(module))
    return f"{what}, " + " and ".join(parts)


def _outputs(module: nn.Module, args: tuple, kwargs: dict) -> list:
    with torch.no_grad():
        return pytree.tree_leaves(module(*args, **kwargs))


def _same_outputs(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        else x == y for x, y in zip(a, b))


def _gradients(module: nn.Module, args: tuple, kwargs: dict):
    """``gradient_stops``' gradients of a fixed random projection of each floating output (a
    stop may act on a returned state alone), or the failure's type (the same in both modes where
    the layer cannot be differentiated at all)."""
    from .gradient_stops import _gradients as gradients
    try:
        return gradients(module, args, kwargs)
    except Exception as e:
        return type(e).__name__


def _same_gradients(a, b) -> bool:
    """Whether two ``_gradients`` agree: the same failure, or every gradient within the
    output dtype's tolerance (autograd may accumulate in another order from run to run)."""
    from .testing import TOLERANCE, rel_rms_error
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    (ga, dtype), (gb, _) = a, b
    return ga.keys() == gb.keys() and all(
        ga[n].shape == gb[n].shape and rel_rms_error(ga[n], gb[n])
        <= TOLERANCE.get(dtype, TOLERANCE[torch.float32])
        for n in ga)


def _reads_training(module: nn.Module) -> str:
    """Where the code reads ``self.training``: the lines of the first ``forward`` that reads
    ``.training`` — the layer's own, else a submodule's that is not ``MODE_DEPENDENT`` — at
    file:line, or the layer's own code in general where none does (a function a ``forward``
    calls may read it, as a write into the input may make the modes differ: not claimed)."""
    for name, m in module.named_modules():
        if isinstance(m, MODE_DEPENDENT):
            continue
        cls = original_class(type(m))             # a converted layer's own
        try:
            lines, start = inspect.getsourcelines(cls.forward)
            file = os.path.basename(inspect.getsourcefile(cls.forward) or "?")
        except (OSError, TypeError):
            continue
        at = [str(start + i) for i, line in enumerate(lines)
              if re.search(r"\.training\b", line.split("#")[0])]
        if at:
            whose = "its own code" if not name else f"{name} ({type(m).__name__})"
            return f"where {whose} reads `self.training` at {file}:{', '.join(at[:3])}" + (
                f" and {len(at) - 3} more lines" if len(at) > 3 else "")
    return ("where its own code computes otherwise (no `forward` of it reads `.training`: a "
            "function one calls may)")


__all__ = ["in_mode", "evaluating", "training_dependence", "MODE_DEPENDENT"]
