"""A converted layer whose weights were cast, moved or renamed after conversion is converted
again for them.

A conversion traces the layer at its weights' dtypes and devices, and every choice it makes
follows from that trace: the precision the plan computes in (it follows the source), the fills
and constants its graphs hold, the folds of the lossy passes. So graphs built for float64 on a
CPU are wrong for the same layer after ``.float()``, ``.half()`` or ``.to("cuda")``, or called
through ``torch.func.functional_call`` with weights of another dtype; and graphs reading
``o_proj.weight`` are wrong once a parametrization or a wrapping module computes that weight from
others. Such a call replays the layer's ``Recipe`` at the weights it now has — the same trace, passes and plan as a fresh
conversion, once per signature, like a recompile — with the recorded example inputs cast as
the weights were cast.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.utils._pytree as pytree

from .errors import UnsupportedTTTError
from .original_class import written_class
from .preparation import out_of_sight
from .as_found import as_found

#: What a conversion was built for: each parameter's and buffer's name, dtype and device, in
#: order.
Signature = tuple[tuple[str, torch.dtype, torch.device], ...]


def weights_signature(weights: dict) -> Signature:
    """The names, dtypes and devices of ``weights`` (a layer's parameters and buffers by name,
    in ``params_and_buffers`` order)."""
    return tuple((name, t.dtype, t.device) for name, t in weights.items())


def describe(signature: Signature) -> str:
    """``"torch.float32 on cpu"``: the weights' most common floating dtype and device."""
    dtypes = Counter(d for _, d, _ in signature if d.is_floating_point)
    devices = Counter(str(v) for _, _, v in signature)
    dtype = dtypes.most_common(1)[0][0] if dtypes else "no floating weights"
    device = devices.most_common(1)[0][0] if devices else "no device"
    return f"{dtype} on {device}"


def described_change(was: Signature, now: Signature) -> str:
    """The weights ``now``, against those ``was``: ``"weights in torch.float32 on cpu"``, and
    the names added and removed when they were renamed."""
    before, after = [name for name, *_ in was], [name for name, *_ in now]
    if before == after:
        return f"weights in {describe(now)}"
    added = [n for n in after if n not in before]
    removed = [n for n in before if n not in after]
    parts = [f"{what} {', '.join(names[:3])}{', …' if len(names) > 3 else ''}"
             for what, names in (("added", added), ("removed", removed)) if names]
    return f"weights in {describe(now)}, " + ("; ".join(parts) or "reordered")


def weights_cast(was: Signature, now: Signature) -> tuple[dict, torch.device | None]:
    """How the weights were cast from ``was`` to ``now``, as ``(dtypes, device)``: each floating
    dtype some weights had, to the dtype most of those weights have now, and the device most
    weights are on now (``None``: no weights). Plain loops, so TorchDynamo reads it through."""
    moves: dict = {}
    before = {name: d for name, d, _ in was}
    for name, d1, _ in now:
        d0 = before.get(name)
        if d0 is not None and d0.is_floating_point and d1.is_floating_point:
            counts = moves.setdefault(d0, {})
            counts[d1] = counts.get(d1, 0) + 1
    dtypes = {d0: max(counts, key=counts.get) for d0, counts in moves.items()}
    devices: dict = {}
    for _, _, v in now:
        devices[v] = devices.get(v, 0) + 1
    return dtypes, (max(devices, key=devices.get) if devices else None)


def recast_recipe(recipe, was: Signature, now: Signature):
    """``recipe`` with its example tensors cast as the weights were (``weights_cast``): a
    floating tensor of a dtype some weights had takes the dtype most of those weights have now,
    and every tensor moves to the device most weights are on now."""
    dtypes, device = weights_cast(was, now)

    def cast(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device=device if device is not None else t.device,
                    dtype=dtypes.get(t.dtype, t.dtype))

    args, kwargs = pytree.tree_map(cast, (tuple(recipe.args), dict(recipe.kwargs)))
    return dataclasses.replace(recipe, args=tuple(args), kwargs=kwargs)


#: A module's hooks around its calls, by attribute
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def recast(module: torch.nn.Module, state, now: Signature):
    """``state`` built again for ``module``'s weights as they are now (signature ``now``) by
    replaying its recipe, as unpickling does, on a stand-in for ``module``: its class as
    written (``written_class``: a parametrization registered on it since conversion kept),
    sharing every attribute, so the user's module is never touched."""
    from .converted import _replay                     # converted imports this module
    where = state.program.module_path or type(module).__name__
    if state.recipe is None:
        raise UnsupportedTTTError(
            f"{where} was converted for weights in {describe(state.weights)} and now has "
            f"{described_change(state.weights, now)}, and it has no record of how it was "
            "converted, so it cannot be converted again for them. Change the original model "
            "as you changed this one, then convert it.")
    cls = written_class(type(module))
    stand_in = cls.__new__(cls)
    stand_in.__dict__.update({k: v for k, v in module.__dict__.items()
                              if k not in ("_ttt2la", "_ttt2la_key")})
    for hooks in _CALL_HOOKS:       # the hooks around a call of ``module`` (a ``Stream``'s that
        if hooks in module.__dict__:    # pass ``ttt_state``) keep to it: the replay is its forward
            stand_in.__dict__[hooks] = type(module.__dict__[hooks])()
    # converted as ``convert`` converts (evaluation mode), out of sight of the call needing it,
    # and outside a compiler's trace of that call (its tracing context would make the
    # conversion's own traces symbolic): torch.compile's first call at a new dtype converts as
    # an eager call does
    with out_of_sight(devices=[v.type for _, _, v in now]), torch._guards.tracing(None), \
            as_found(stand_in):
        new = _replay(stand_in, recast_recipe(state.recipe, state.weights, now))
    return dataclasses.replace(new, runs=state.runs, fallbacks=state.fallbacks, weights=now,
                               variant=f", {described_change(state.weights, now)}")


__all__ = ["Signature", "weights_signature", "describe", "described_change", "weights_cast",
           "recast_recipe", "recast"]
