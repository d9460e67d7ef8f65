"""Hooks on a TTT layer's submodules, which a converted layer cannot run.

A converted layer computes its submodules' work (projections, norms) inside its own graphs and
never calls them, so a hook on one of them — registered on it, or for every module with
``torch.nn.modules.module.register_module_*_hook`` — would not run there: an observing hook
would never see a tensor, a hook that changes an output would be silently dropped. And a trace
runs the hooks present on fake tensors, baking a changing hook's effect in once. So conversion
refuses a layer whose submodules carry hooks, and a converted layer whose submodules gain
hooks later runs its code as written while they are there (an exact conversion) or refuses (a
lossy one). The layer's own hooks are not concerned: they run around its converted forward as
around any module's.
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as _nn

#: Each hook table of a module, with how a message names a hook in it.
_TABLES = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
           "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}

#: The tables of hooks every module runs, by the same names.
_GLOBAL_TABLES = {"_global_forward_pre_hooks": "forward pre-hook",
                  "_global_forward_hooks": "forward hook",
                  "_global_backward_pre_hooks": "backward pre-hook",
                  "_global_backward_hooks": "backward hook"}


def hooked(layer: torch.nn.Module) -> bool:
    """Whether any hook would run on a submodule of ``layer``: asked by a call that the walk of
    the layer's modules (``module_walk``, which looks at the same tables) does not pass."""
    return bool(_nn._global_forward_pre_hooks or _nn._global_forward_hooks
                or _nn._global_backward_pre_hooks or _nn._global_backward_hooks
                or _submodule_hooked(layer))


def _submodule_hooked(module: torch.nn.Module) -> bool:
    for child in module._modules.values():
        if child is not None and (child._forward_pre_hooks or child._forward_hooks
                                  or child._backward_pre_hooks or child._backward_hooks
                                  or _submodule_hooked(child)):
            return True
    return False


@torch.compiler.disable
def hooks_described(layer: torch.nn.Module) -> str:
    """``"a forward hook on o_proj (log_output)"``: the first hook that would run on a
    submodule of ``layer`` ("" when none). Read outside any compiled graph: a message only."""
    for table, what in _GLOBAL_TABLES.items():
        if getattr(_nn, table):
            name = table.removeprefix("_global_").removesuffix("s")
            return (f"a {what} registered for every module "
                    f"(torch.nn.modules.module.register_module_{name})")
    for path, sub in layer.named_modules():
        for table, what in _TABLES.items():
            hooks = getattr(sub, table)
            if path and hooks:
                fn = next(iter(hooks.values()))
                return f"a {what} on {path} ({getattr(fn, '__qualname__', type(fn).__name__)})"
    return ""


def refusal(layer_name: str, found: str) -> str:
    """Why a layer with hooks on its submodules is not converted, and what to do."""
    return (f"{layer_name} has {found}. A converted layer computes its submodules' work in "
            "its own graphs and never calls them, so a hook there could not run. Remove it "
            "before converting and register it again afterwards (the converted layer then runs "
            "its code as written while it is there), or register it on the layer itself, whose "
            "hooks run as on any module. For torch.nn.utils.weight_norm or spectral_norm, use "
            "their torch.nn.utils.parametrizations forms.")


__all__ = ["hooked", "hooks_described", "refusal"]
