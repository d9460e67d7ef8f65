"""Torch's global settings a converted layer's code reads, guarded at every call.

A branch on a setting — ``if torch.are_deterministic_algorithms_enabled():``, on
``torch.get_default_dtype()``, ``torch.is_inference_mode_enabled()``,
``torch.is_autocast_enabled()``, a ``torch.backends`` flag, the matmul precision, the thread count — is decided once, when the
layer is traced, and the converted graphs hold the branch taken then: after
``torch.use_deterministic_algorithms(True)`` or inside ``torch.inference_mode()`` the original
took the other branch and the converted layer silently kept the old one's output (2.4 relative
RMS off on a two-branch layer). ``SettingsGuard`` finds, at conversion, which of these readers
the layer's code reads (``global_guard.names_read``: its methods and the functions they call or
hold), by the names its code holds (``from torch import get_default_dtype`` is found as well,
and a ``torch.backends`` flag where the code names both its module and it) and by the objects
those names hold, whatever they are spelled (``loaded_values``: ``gdd = torch.get_default_dtype``,
``import torch.backends.mkldnn as mk``, a reader the layer holds; found by name only, these
aliases ran the traced branch, 0.97 relative RMS off). At each call it reads those settings
again: a change makes ``changed_call`` run the code as written (exact levels) or refuse naming
the line (lossy ones). A layer that reads none keeps no guard; one that does pays one call and
one comparison a call (0.1 µs; 0.25 µs for autocast's state). The grad mode is not here: a
branch on it is refused at conversion (``call_variation``), since the conversion's own check
runs without gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .attribute_guard import Change
from .global_guard import LayerCode, names_read


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast():
    """``False`` outside autocast (one C call), else each device's switch and dtype."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return False
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda"))


def _c(name: str, fallback: Callable[[], object]) -> Callable[[], object]:
    """torch's C getter ``name`` where this torch has it (a few tens of nanoseconds), else
    ``fallback`` (the public attribute, a few hundred)."""
    return getattr(torch._C, name, fallback)


#: the readers of a setting by the name the code calls them: what to call it, how to read it
_READERS: dict[str, tuple[str, Callable[[], object]]] = {
    "are_deterministic_algorithms_enabled": (
        "torch.are_deterministic_algorithms_enabled()", torch.are_deterministic_algorithms_enabled),
    "is_deterministic_algorithms_warn_only_enabled": (
        "torch.is_deterministic_algorithms_warn_only_enabled()",
        torch.is_deterministic_algorithms_warn_only_enabled),
    "get_deterministic_debug_mode": (
        "torch.get_deterministic_debug_mode()", torch.get_deterministic_debug_mode),
    "get_default_dtype": ("torch.get_default_dtype()", torch.get_default_dtype),
    "is_inference_mode_enabled": (
        "torch.is_inference_mode_enabled()", torch.is_inference_mode_enabled),
    "get_float32_matmul_precision": (
        "torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision),
    "get_num_threads": ("torch.get_num_threads()", torch.get_num_threads),
    "get_num_interop_threads": ("torch.get_num_interop_threads()", torch.get_num_interop_threads),
    "is_anomaly_enabled": ("torch.is_anomaly_enabled()", torch.is_anomaly_enabled),
    "is_anomaly_check_nan_enabled": (
        "torch.is_anomaly_check_nan_enabled()", torch.is_anomaly_check_nan_enabled),
}
for _name in ("is_autocast_enabled", "is_autocast_cpu_enabled", "get_autocast_dtype",
              "get_autocast_gpu_dtype", "get_autocast_cpu_dtype"):
    _READERS[_name] = ("the autocast state (cpu, cuda)", _autocast)

#: ``torch.backends`` flags, by the names the code reads them through: found where the code
#: names both (``torch.backends.cudnn.enabled``, ``from torch.backends import cudnn``)
_FLAGS: dict[tuple[str, str], tuple[str, Callable[[], object]]] = {
    ("matmul", "allow_tf32"): (
        "torch.backends.cuda.matmul.allow_tf32",
        _c("_get_cublas_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32)),
    ("cudnn", "allow_tf32"): (
        "torch.backends.cudnn.allow_tf32",
        _c("_get_cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32)),
    ("matmul", "allow_fp16_reduced_precision_reduction"): (
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
    ("matmul", "allow_bf16_reduced_precision_reduction"): (
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
    ("cudnn", "enabled"): (
        "torch.backends.cudnn.enabled",
        _c("_get_cudnn_enabled", lambda: torch.backends.cudnn.enabled)),
    ("mkldnn", "enabled"): (
        "torch.backends.mkldnn.enabled",
        _c("_get_mkldnn_enabled", lambda: torch.backends.mkldnn.enabled)),
    ("opt_einsum", "enabled"): (
        "torch.backends.opt_einsum.enabled", lambda: torch.backends.opt_einsum.enabled),
    ("cudnn", "deterministic"): (
        "torch.backends.cudnn.deterministic",
        _c("_get_cudnn_deterministic", lambda: torch.backends.cudnn.deterministic)),
    ("cudnn", "benchmark"): (
        "torch.backends.cudnn.benchmark",
        _c("_get_cudnn_benchmark", lambda: torch.backends.cudnn.benchmark)),
}
_FLAG_NAMES = frozenset(n for pair in _FLAGS for n in pair)

#: the objects behind those names, found under whatever name the code holds them
#: (``gdd = torch.get_default_dtype``, ``import torch.backends.mkldnn as mk``)
_OBJECTS: dict[str, object] = {
    **{name: getattr(torch, name) for name in _READERS if hasattr(torch, name)},
    "matmul": torch.backends.cuda.matmul, "cudnn": torch.backends.cudnn,
    "mkldnn": torch.backends.mkldnn, "opt_einsum": torch.backends.opt_einsum}


@dataclass(frozen=True)
class SettingsGuard:
    """The global settings a converted layer's code reads, and their values at conversion:
    ``read() == value`` while none changed (one call and one comparison per call)."""

    read: Callable[[], object]      # the settings now, as one value
    value: object                   # ``read()`` at conversion
    readers: tuple[Callable[[], object], ...]
    names: tuple[str, ...]          # "torch.get_default_dtype() (read at file:line (`code`))"

    @classmethod
    def of(cls, layer: torch.nn.Module, layer_code: LayerCode | None = None
           ) -> "SettingsGuard | None":
        """Read them now (``None``: the layer's code names none); ``layer_code``: the layer's,
        where the caller has read it already."""
        found = names_read(layer, frozenset(_READERS) | _FLAG_NAMES, _OBJECTS, layer_code)
        entries: dict[str, tuple[str, Callable[[], object]]] = {}
        for name, where in found.items():
            if name in _READERS:
                what, read = _READERS[name]
                entries.setdefault(what, (f"{what} (read at {where})", read))
        for (module, flag), (what, read) in _FLAGS.items():
            if module in found and flag in found:
                entries.setdefault(what, (f"{what} (read at {found[flag]})", read))
        if not entries:
            return None
        names, readers = zip(*entries.values())
        if len(readers) == 1:
            read = readers[0]
        else:
            def read(readers=readers):
                return tuple([r() for r in readers])
        return cls(read, read(), tuple(readers), tuple(names))

    def changed(self) -> Change | None:
        """The first setting that differs from conversion (``None`` when none does)."""
        now = self.read()
        if now == self.value:
            return None
        values = (self.value,) if len(self.readers) == 1 else self.value
        news = (now,) if len(self.readers) == 1 else now
        for what, then, value in zip(self.names, values, news):
            if value != then:
                return Change(what, then, value)
        return None


__all__ = ["SettingsGuard"]
