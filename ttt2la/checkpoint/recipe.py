"""How to rebuild a model before its weights are loaded: a bundled model, a factory, or a
Hugging Face class.

A recipe is recorded in a converted checkpoint's manifest, so ``ttt2la.load`` can build the same
module again: ``{"kind": "zoo", "name": ...}``, ``{"kind": "factory", "factory":
"pkg.module:function", "kwargs": {...}}`` or ``{"kind": "hf", "auto_class": ..., "class": ...,
"trust_remote_code": ...}`` (the configuration is the directory's own ``config.json``), or
``{"kind": "module", "class": ...}`` when only the class is known (``load`` then needs ``model=``).
"""
from __future__ import annotations

import importlib

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import first_line
from .errors import CheckpointError, ManifestError, read_json

#: Auto classes tried, in order, for a Hugging Face directory whose ``auto_map`` or registered
#: model type names no other.
HF_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModel")
HF_CONFIG = "config.json"


@dataclass
class Recipe:
    """One way to build a model with freshly initialised weights (see the module docstring)."""

    kind: str
    name: str | None = None                 # zoo
    factory: str | None = None              # factory: "pkg.module:attr"
    kwargs: dict = field(default_factory=dict)
    auto_class: str | None = None           # hf
    model_class: str | None = None          # hf: the class that was built, for messages
    trust_remote_code: bool = False         # hf

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, {}, False) or k == "kind"}

    @classmethod
    def from_dict(cls, d: dict, where: Path) -> "Recipe":
        try:
            recipe = cls(**d)
        except TypeError as e:
            raise ManifestError(f"{where}: malformed model recipe {d!r} ({e})") from e
        texts = (recipe.name, recipe.factory, recipe.auto_class, recipe.model_class)
        if not (isinstance(recipe.kind, str) and isinstance(recipe.kwargs, dict)
                and isinstance(recipe.trust_remote_code, bool)
                and all(t is None or isinstance(t, str) for t in texts)):
            raise ManifestError(f"{where}: malformed model recipe {d!r} (a field of another "
                                  "type); convert the source checkpoint again")
        if recipe.kind not in ("zoo", "factory", "hf", "module"):
            raise ManifestError(f"{where}: unknown model recipe kind {recipe.kind!r}")
        return recipe

    def with_factory(self, factory) -> "Recipe":
        """This recipe built by the caller's ``factory`` instead: called with the recorded
        keyword arguments when the recipe is a factory's, with none otherwise."""
        return Recipe("factory", factory=factory,
                      kwargs=dict(self.kwargs) if self.kind == "factory" else {})

    def build(self, directory: Path | None = None, *, trust_remote_code: bool = False,
              trust_factory: bool = False) -> torch.nn.Module:
        """The model with fresh weights, in eval mode; ``directory`` holds the manifest (and an
        HF config). A factory other than a bundled model's, and a Hugging Face directory's own
        code, run only when the caller trusts them (``trust_factory``, ``trust_remote_code``):
        what the manifest records never grants that trust (``ttt2la.checkpoint.trust``)."""
        if self.kind == "zoo":
            from ..cli import ZOO, build_zoo_model

            if self.name not in ZOO:
                raise CheckpointError(f"unknown bundled model {self.name!r}; one of "
                                      f"{', '.join(sorted(ZOO))}")
            return build_zoo_model(self.name)
        if self.kind == "factory":
            from .manifest import MANIFEST_NAME
            from .trust import check_factory_trusted

            where = Path(directory) / MANIFEST_NAME if directory is not None else "the recipe"
            check_factory_trusted(self.factory, self.kwargs, where, trusted=trust_factory)
            return build_from_factory(self.factory, self.kwargs, "the recorded factory")
        if self.kind == "module":
            raise CheckpointError(f"no recipe records how to build {self.model_class}; pass "
                                  "the model to build (model=...)")
        return build_hf(directory, trust_remote_code, self.auto_class)[0].eval()


# -- factories ----------------------------------------------------------------------------------
def resolve_factory(spec: str, name: str = "--model"):
    """The callable named by ``"pkg.module:attr"`` (``attr`` may be dotted), or ``spec`` itself
    when it is a callable; ``name``: the argument as the caller knows it (``--model``, or
    ``factory`` in ``ttt2la.save``)."""
    if callable(spec):
        return spec
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(f"{name} {spec!r}: expected pkg.module:factory, e.g. "
                              "mypkg.models:build_model")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise CheckpointError(f"{name} {spec!r}: unknown factory, cannot import "
                              f"{module_name} ({e})") from e
    except Exception as e:          # the module's own code fails: a SyntaxError, a raise ...
        raise CheckpointError(f"{name} {spec!r}: importing {module_name} failed with "
                              f"{type(e).__name__}: {_first_line(e)}; fix the module or name "
                              "another factory") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise CheckpointError(f"{name} {spec!r}: unknown factory, {module_name} has no "
                                  f"{attr}") from e
    if not callable(obj):
        raise CheckpointError(f"{name} {spec!r}: {attr} is a {type(obj).__name__}, not a "
                              "callable that builds a model")
    return obj


def build_from_factory(spec: str, kwargs: dict, name: str = "--model") -> torch.nn.Module:
    """Call the factory ``spec`` with ``kwargs`` and check it built a module."""
    factory = resolve_factory(spec, name)
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise CheckpointError(f"{name} {spec!r}: the factory failed with {kwargs or 'no'} "
                              f"keyword arguments: {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"{name} {spec!r}: the factory returned a "
                              f"{type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def inline_config(text) -> bool:
    """Whether ``--config`` holds the JSON itself rather than a file's path (an array written
    inline is JSON too, refused as no object by ``read_config``)."""
    return isinstance(text, str) and text.lstrip().startswith(("{", "["))


def read_config(text: str | Path) -> dict:
    """The keyword arguments of ``--config``: a JSON object written inline (``'{"dim": 64}'``)
    or the path of a JSON file holding one."""
    import json

    if inline_config(text):
        where = "--config"
        try:
            data = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"--config {text}: not a JSON object ({e})") from e
    else:
        where, data = text, read_json(Path(text))
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: expected a JSON object of keyword arguments, found a "
                              f"{type(data).__name__}")
    return data


# -- Hugging Face -------------------------------------------------------------------------------
def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise CheckpointError('reading a Hugging Face model directory needs transformers: '
                              'pip install "ttt2la[hf]"') from e
    return transformers


def build_hf(directory: Path, trust_remote_code: bool = False,
             auto_class: str | None = None) -> tuple[torch.nn.Module, Recipe]:
    """A model built from the Hugging Face directory's ``config.json`` (fresh weights), and the
    recipe that builds it again. Remote code (``auto_map``) runs only with ``trust_remote_code``."""
    directory = Path(directory)
    config_path = directory / HF_CONFIG
    raw = read_config(config_path)
    auto_map = raw.get("auto_map") or {}
    if auto_map and not trust_remote_code:
        raise CheckpointError(f"{config_path}: the model class comes from code in the "
                              f"directory (auto_map: {', '.join(sorted(auto_map))}); pass "
                              "--trust-remote-code (trust_remote_code=True) if you trust it")
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(directory), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{config_path}: transformers cannot read this configuration "
                              f"(model_type {raw.get('model_type')!r}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); is the model type "
                              "registered, or does it need --trust-remote-code?") from e
    names = [auto_class] if auto_class else \
        [a for a in HF_AUTO_CLASSES if a in auto_map] or list(HF_AUTO_CLASSES)
    errors = []
    for name in names:
        try:
            model = getattr(transformers, name).from_config(
                config, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, AttributeError) as e:
            errors.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        except Exception as e:      # the directory's own code is missing or fails on import
            code = f" (auto_map: {auto_map[name]})" if isinstance(auto_map, dict) and \
                isinstance(auto_map.get(name), str) else ""
            raise CheckpointError(f"{config_path}: building the model with {name}{code} failed "
                                  f"with {type(e).__name__}: {_first_line(e)}; is the model's "
                                  "code in the directory, and does it import?") from e
        cls = type(model)
        return model, Recipe("hf", auto_class=name, model_class=f"{cls.__module__}.{cls.__name__}",
                             trust_remote_code=bool(auto_map))
    raise CheckpointError(f"{config_path}: no model class for model_type "
                          f"{raw.get('model_type')!r} ({'; '.join(errors)})")


def _first_line(e: BaseException) -> str:
    """The first line of an error's message (a remote or user module's error may run long)."""
    return first_line(e) or "(no message)"


def is_hf_directory(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / HF_CONFIG).is_file()


__all__ = ["Recipe", "resolve_factory", "build_from_factory", "inline_config", "read_config",
           "build_hf", "is_hf_directory", "HF_AUTO_CLASSES"]
