"""The model a command line names: a Hugging Face directory, a state dict with a factory, a
converted checkpoint, or a bundled model — built, with its weights loaded, and described so the
conversion can be recorded and replayed."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError
from .manifest import MANIFEST_NAME, Manifest
from .recipe import Recipe, build_from_factory, build_hf, is_hf_directory
from .weights import fit_weights, read_weights, sha256_files, weight_files


@dataclass
class Source:
    """A model ready to convert, the recipe that rebuilds it and where its weights came from."""

    model: torch.nn.Module
    recipe: Recipe
    info: dict                              # {"path", "sha256", "files"} or {"zoo", "seed"}
    inputs: list[Path] = field(default_factory=list)    # paths an output must not overwrite
    hf_dir: Path | None = None              # an HF directory whose other files are copied


def open_checkpoint(path, *, factory: str | None = None, kwargs: dict | None = None,
                    trust_remote_code: bool = False, trust_factory: bool = False) -> Source:
    """Build the model of checkpoint ``path`` and load its weights, refusing anything that does
    not fit. The weights are read (and so checked) before any model code runs. A converted
    checkpoint's recorded factory runs only when trusted (``trust_factory``, or ``factory``
    given, which is then called with the recorded keyword arguments unless ``kwargs`` are)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    files = weight_files(path)
    root = path if path.is_dir() else None
    info = {"path": str(path), **sha256_files(files, root)}
    tensors = read_weights(path)
    hf_dir = None
    converted = path.is_dir() and (path / MANIFEST_NAME).is_file()
    if factory is not None and converted and kwargs is None:
        recipe = Recipe.from_dict(Manifest.read(path).recipe, path / MANIFEST_NAME)
        recipe = recipe.with_factory(factory)
        model = recipe.build(path, trust_factory=True)
    elif factory is not None:
        model, recipe = build_from_factory(factory, kwargs or {}), \
            Recipe("factory", factory=factory, kwargs=dict(kwargs or {}))
    elif converted:
        recipe = Recipe.from_dict(Manifest.read(path).recipe, path / MANIFEST_NAME)
        model = recipe.build(path, trust_remote_code=trust_remote_code,
                             trust_factory=trust_factory)
        hf_dir = path if recipe.kind == "hf" else None
    elif is_hf_directory(path):
        model, recipe = build_hf(path, trust_remote_code)
        model, hf_dir = model.eval(), path
    else:
        raise CheckpointError(f"{path}: a state dict needs the code that builds its model: pass "
                              "--model pkg.module:factory (and --config kwargs.json)")
    fit_weights(model, tensors, path)
    return Source(model.eval(), recipe, info, [path], hf_dir)


def open_zoo(name: str, seed: int = 0) -> Source:
    """A bundled model with weights drawn from ``seed``."""
    from ..cli import build_zoo_model

    return Source(build_zoo_model(name, seed), Recipe("zoo", name=name),
                  {"zoo": name, "seed": seed})


__all__ = ["Source", "open_checkpoint", "open_zoo"]
