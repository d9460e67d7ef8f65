"""The weights a lossy conversion's folds were measured on, and a warning when others are loaded.

A lossy pass folds constants measured on the layer as it was converted: ``absorb_lr``'s mean
rate, ``collapse_mlp``'s collapsed matrix, the momentum's accumulation factor. Loading a
checkpoint into the converted model replaces the weights but not those constants, so the layer
then computes the loaded weights' function with constants fitted to other weights, and the
report's drift no longer describes it — a wrong answer nothing would show. ``load_state_dict``
into such a layer therefore warns (``FoldsFromOtherWeightsWarning``) when the loaded values
differ from the ones the folds were measured on. Folds replayed from a report (``folds=``, or
``ttt2la.load`` of a converted checkpoint) were chosen knowingly, and are not watched.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch

from .ir import params_and_buffers


class FoldsFromOtherWeightsWarning(UserWarning):
    """Weights loaded into a lossy converted layer differ from those its folds were measured
    on: the folded constants stay as they were."""


@dataclass(frozen=True)
class FoldedWeights:
    """Which passes of a lossy layer folded constants (``folds``, by name) and a fingerprint of
    the weights they folded them from."""

    layer: str
    folds: tuple[str, ...]
    fingerprint: tuple

    @classmethod
    def of(cls, module: torch.nn.Module, layer: str, results, replayed) -> "FoldedWeights | None":
        """The folds the passes ``results`` measured (not those ``replayed`` names), or None."""
        measured = tuple(r.name for r in results if r.folded and r.name not in replayed)
        if not measured:
            return None
        return cls(layer, measured, fingerprint(module))


def fingerprint(module: torch.nn.Module) -> tuple:
    """Each parameter's and buffer's name, shape and float64 sum and sum of squares: the same
    values give the same fingerprint, and loading others changes it."""
    out = []
    for name, t in params_and_buffers(module).items():
        with torch.no_grad():
            x = t.detach().to(torch.float64)
            out.append((name, tuple(t.shape), float(x.sum()), float(x.square().sum())))
    return tuple(out)


def watch(module: torch.nn.Module) -> None:
    """Warn when ``load_state_dict`` (of ``module`` or of a model holding it) loads weights its
    folds were not measured on."""
    module.register_load_state_dict_post_hook(_loaded)


def _loaded(module: torch.nn.Module, incompatible_keys) -> None:
    state = getattr(module, "_ttt2la", None)
    folded = getattr(state, "folded_weights", None)
    if folded is None or any(t.is_meta for t in params_and_buffers(module).values()):
        return                          # on the meta device nothing loaded holds values
    if fingerprint(module) == folded.fingerprint:
        return
    where = folded.layer or "the converted layer"
    warnings.warn(FoldsFromOtherWeightsWarning(
        f"ttt2la: {where}: load_state_dict loaded weights other than those the conversion "
        f"folded {', '.join(folded.folds)} from; the folded constants stay those of the old "
        "weights, so the layer is not the loaded weights' conversion and the report's drift "
        "does not describe it. To fold from the loaded weights, load them into the original "
        "model and convert that; to keep these constants knowingly (a model trained after "
        "conversion, loaded again), convert with folds=report.folds() and load then."),
        stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside torch and ttt2la: the user's call of
    ``load_state_dict``, which the warning names."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


__all__ = ["FoldsFromOtherWeightsWarning", "FoldedWeights", "fingerprint", "watch"]
