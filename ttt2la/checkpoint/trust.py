"""Which factory a converted checkpoint may have called: its manifest names the function that
builds its model, and a checkpoint someone else made can name any importable callable
(``os:system`` with a command as its keyword argument). Like a Hugging Face directory's own
code, such a factory is imported and called only when the caller vouches for it — by passing the
model or the factory, or by opting in — unless it is one of ttt2la's own bundled models.
"""
from __future__ import annotations

import inspect

from .errors import UnsafeCheckpointError

#: The module whose model classes and builders a manifest may name without an opt-in.
BUNDLED_MODULE = "ttt2la.zoo"


def is_bundled_factory(spec) -> bool:
    """Whether ``spec`` (``"pkg.module:attr"``) names a model class or builder that ttt2la's zoo
    exports: decided from the text and the zoo's own names, before anything else is imported."""
    module_name, _, attr = str(spec).partition(":")
    if module_name != BUNDLED_MODULE or not attr.isidentifier():
        return False
    import torch

    from .. import zoo

    obj = getattr(zoo, attr, None) if attr in zoo.__all__ else None
    if inspect.isclass(obj):
        return issubclass(obj, torch.nn.Module)
    return inspect.isfunction(obj) and obj.__module__.startswith(BUNDLED_MODULE)


def check_factory_trusted(spec, kwargs: dict, where, *, trusted: bool) -> None:
    """Refuse to import or call the factory a manifest names unless ``trusted`` (the caller
    opted in) or it is a bundled model; the message says what the manifest names and how to
    opt in."""
    if trusted or is_bundled_factory(spec):
        return
    raise UnsafeCheckpointError(
        f"{where}: names the factory {spec!r} (keyword arguments {kwargs or {}}) to build its "
        "model; a checkpoint's manifest can name any importable function, so ttt2la calls one "
        "only when you vouch for it. If you trust this checkpoint, pass the model "
        f"(load(DIR, model=...)), the factory (load(DIR, factory={str(spec)!r}); --model "
        f"{spec} on the command line) or trust_factory=True (--trust-factory)")


__all__ = ["BUNDLED_MODULE", "is_bundled_factory", "check_factory_trusted"]
