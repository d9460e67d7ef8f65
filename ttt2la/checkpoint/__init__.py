"""Converted checkpoints: ``save`` writes a converted model as a directory, ``load`` rebuilds it.

A converted checkpoint directory holds ``model.safetensors`` (the weights under their original
parameter names), ``ttt2la.json`` (the manifest: how to build the model, the conversion asked
for, the example-input spec and the conversion report per layer, with hashes) and ``report.md``.
For a Hugging Face model it is again a Hugging Face directory (``config.json`` beside the
weights), so ``from_pretrained`` reads the unconverted model from it. ``load`` builds the same
module, loads the weights and replays the recorded conversion — with the constants lossy passes
folded, so no calibration data is needed — then checks the result against the manifest.
"""
from __future__ import annotations

import shutil

from pathlib import Path

import torch

from ..original_class import original_class
from .errors import CheckpointError, ManifestError, UnsafeCheckpointError, WeightMismatchError
from .example_inputs import INPUTS_NAME, build_inputs, describe, write_inputs
from .manifest import MANIFEST_NAME, MANIFEST_VERSION, Manifest, replay_differences
from .recipe import HF_CONFIG, Recipe
from .source import Source, open_checkpoint, open_zoo
from .weights import (SAFETENSORS_INDEX, SAFETENSORS_NAME, alias_groups, read_weight_file,
                      sha256_file, sha256_state, unique_state, weight_problems, write_weights)
from .writing import atomic_directory, check_output_dir

REPORT_NAME = "report.md"
#: Files of a source Hugging Face directory not copied to the converted one (weights, ours).
_NOT_COPIED = {SAFETENSORS_INDEX, MANIFEST_NAME, REPORT_NAME, INPUTS_NAME}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def write_checkpoint(converted: torch.nn.Module, out, *, recipe: Recipe, spec: dict,
                     source: dict, inputs: tuple[tuple, dict | None] | None = None,
                     force: bool = False, hf_dir: Path | None = None, verify=None) -> Path:
    """Write ``converted`` to the directory ``out`` atomically (see the module docstring).

    ``spec`` is the example-input spec (``inputs`` are stored beside the weights when its kind
    is ``file``), ``source`` where the weights came from, ``hf_dir`` a Hugging Face directory
    whose configuration and other small files are copied. ``verify(tmp)`` is called on the
    complete temporary directory before it is renamed to ``out``, and may refuse it.
    """
    import ttt2la

    report = converted.ttt2la_report
    out = Path(out)
    spec = dict(spec)
    with atomic_directory(out, force=force) as tmp:
        write_weights(converted, tmp / SAFETENSORS_NAME)
        if spec["kind"] == "file":
            write_inputs(*inputs, tmp / INPUTS_NAME)
            spec.update(file=INPUTS_NAME, sha256=sha256_file(tmp / INPUTS_NAME))
        if recipe.kind == "hf":
            _write_hf_files(converted, tmp, hf_dir)
        state = unique_state(converted)
        manifest = Manifest(
            ttt2la_version=ttt2la.__version__, torch_version=torch.__version__,
            level=report.level, backend=report.backend, strict=report.strict,
            recipe=recipe.to_dict(), example_inputs=spec, source=source,
            weights={"file": SAFETENSORS_NAME, "sha256": sha256_file(tmp / SAFETENSORS_NAME),
                     "tensors": {k: [str(v.dtype).split(".")[-1], list(v.shape)]
                                 for k, v in state.items()}},
            report=report.to_dict())
        (tmp / REPORT_NAME).write_text(_report_markdown(report, manifest))
        manifest.files = sorted(p.name for p in tmp.iterdir()) + [MANIFEST_NAME]
        manifest.write(tmp)
        if verify is not None:
            verify(tmp)
    return out


def _write_hf_files(model: torch.nn.Module, tmp: Path, hf_dir: Path | None) -> None:
    if hf_dir is not None:
        for f in sorted(Path(hf_dir).iterdir()):
            if f.is_file() and f.name not in _NOT_COPIED and f.suffix not in _WEIGHT_SUFFIXES:
                shutil.copy2(f, tmp / f.name)
    if not (tmp / HF_CONFIG).exists():
        model.config.to_json_file(str(tmp / HF_CONFIG))


def _report_markdown(report, manifest: Manifest) -> str:
    recipe = manifest.recipe
    built = {"zoo": lambda: f"bundled model `{recipe.get('name')}`",
             "factory": lambda: f"`{recipe.get('factory')}(**{recipe.get('kwargs', {})})`",
             "hf": lambda: f"Hugging Face `{recipe.get('model_class')}` via "
                           f"`{recipe.get('auto_class')}`",
             "module": lambda: f"`{recipe.get('model_class')}` (pass `model=` to load)"}
    source = manifest.source.get("path") or f"zoo {manifest.source.get('zoo')}"
    lines = [report.to_markdown(), "", "## Checkpoint", "",
             f"- model: {built.get(recipe['kind'], lambda: recipe['kind'])()}",
             f"- source weights: `{source}`"
             + (f", sha256 `{manifest.source['sha256']}`" if manifest.source.get("sha256") else ""),
             f"- example inputs: {describe(manifest.example_inputs)}",
             f"- ttt2la {manifest.ttt2la_version}, torch {manifest.torch_version}",
             f"- reload with {_reload_hint(recipe)}", ""]
    return "\n".join(lines)


def _reload_hint(recipe: dict) -> str:
    """How to load this checkpoint: a factory other than a bundled model's needs the caller's
    trust (``checkpoint.trust``)."""
    from .trust import is_bundled_factory

    if recipe.get("kind") == "factory" and not is_bundled_factory(recipe.get("factory")):
        return (f"`ttt2la.load(DIR, factory=\"{recipe.get('factory')}\")` (or "
                "`trust_factory=True`, `--trust-factory`)")
    return "`ttt2la.load(DIR)`"


# -- public API ---------------------------------------------------------------------------------
def save(converted: torch.nn.Module, directory, *, factory: str | None = None,
         config: dict | None = None, example_inputs=None, example_kwargs: dict | None = None,
         force: bool = False) -> Path:
    """Write a model returned by ``ttt2la.convert`` to ``directory`` so ``ttt2la.load`` can
    rebuild it.

    ``example_inputs`` (and ``example_kwargs``) are the ones it was converted with (not needed
    when ``convert`` inferred them); they are stored beside the weights. ``factory``
    (``"pkg.module:function"``) and ``config`` (its keyword arguments) say how to build the
    model again; Hugging Face models need neither, and without them ``load`` needs ``model=``.
    The directory is written atomically and an existing path is replaced only with ``force``.
    """
    from ..report import ConversionReport
    from ..validation import InvalidInputError, check_flag, check_model
    from .arguments import as_directory, check_config, example_arguments, factory_spec

    check_model(converted)
    if not isinstance(getattr(converted, "ttt2la_report", None), ConversionReport):
        raise InvalidInputError(f"{type(converted).__name__} was not returned by ttt2la.convert "
                                "(it has no ttt2la_report); convert it first")
    directory = as_directory(directory)
    check_flag(force, "force")
    factory, config = factory_spec(factory), check_config(config)
    inputs = example_arguments(example_inputs, example_kwargs)
    check_output_dir(directory, force=force, name="directory")
    recipe = _recipe_for(converted, factory, config)
    if example_inputs is None and not example_kwargs:
        if not any(n.startswith("example inputs inferred") for n in converted.ttt2la_report.notes):
            raise InvalidInputError("save needs the example_inputs the model was converted with, "
                                    "so that load can replay the same conversion")
        spec, inputs = {"kind": "inferred"}, None
    else:
        spec = {"kind": "file"}
    _check_rebuilds(converted, recipe, directory)
    source = {"sha256": sha256_state(unique_state(converted)), "held_in_memory": True}
    return write_checkpoint(converted, directory, recipe=recipe, spec=spec, source=source,
                            inputs=inputs, force=force,
                            verify=lambda tmp: check_reads_back(converted, tmp, directory,
                                                                 recipe, inputs))


def _recipe_for(model: torch.nn.Module, factory: str | None, config: dict | None) -> Recipe:
    if factory is not None:
        from .recipe import resolve_factory

        resolve_factory(factory, "factory")
        return Recipe("factory", factory=factory, kwargs=dict(config or {}))
    cls = original_class(type(model))
    name = f"{cls.__module__}.{cls.__qualname__}"
    if hasattr(model, "config") and any(c.__name__ == "PreTrainedModel" for c in cls.__mro__):
        return Recipe("hf", auto_class=_hf_auto_class(model, cls), model_class=name,
                      trust_remote_code=bool(getattr(model.config, "auto_map", None)))
    return Recipe("module", model_class=name)


def _check_rebuilds(converted: torch.nn.Module, recipe: Recipe, directory) -> None:
    """Refuse to write a checkpoint ``load`` could not read back: the model the factory builds
    must take the converted model's weights (a parametrization registered, or a submodule
    changed, after it was built would not be rebuilt). Built on the meta device: shapes, no
    memory; a factory that cannot build there is left to ``load``."""
    if recipe.kind != "factory":
        return
    from .recipe import resolve_factory

    build = resolve_factory(recipe.factory, "factory")
    try:
        with torch.device("meta"):
            built = build(**recipe.kwargs)
    except TypeError as e:          # the arguments: meta tensors raise no TypeError of their own
        raise CheckpointError(
            f"directory {directory}: not written, since load could not rebuild the model: "
            f"{recipe.factory} does not take the config {recipe.kwargs} ({e}). Pass the keyword "
            "arguments that build this model as config.") from e
    except Exception:               # a factory that needs values to build: load will tell
        return
    if not isinstance(built, torch.nn.Module):
        return
    state = converted.state_dict()
    problems = weight_problems(built, {names[0]: state[names[0]]
                                       for names in alias_groups(converted)})
    if problems:
        raise CheckpointError(
            f"directory {directory}: not written, since load could not read it back: the model "
            f"that {recipe.factory} builds with {recipe.kwargs or 'no arguments'} does not take "
            f"this model's weights ({'; '.join(problems)}). A parametrization registered after "
            "the model was built is not rebuilt by the factory: remove it first "
            "(torch.nn.utils.parametrize.remove_parametrizations(module, name)), or save with the "
            "factory and config that build this model.")


def _hf_auto_class(model, cls) -> str | None:
    import transformers

    from .recipe import HF_AUTO_CLASSES

    for name in HF_AUTO_CLASSES:
        try:
            if getattr(transformers, name)._model_mapping[type(model.config)] is cls:
                return name
        except (KeyError, AttributeError, ValueError):
            continue
    return None


def load(directory, model: torch.nn.Module | None = None, *, factory=None,
         trust_factory: bool = False, trust_remote_code: bool = False,
         compile: bool | str | None = None) -> torch.nn.Module:
    """Rebuild the converted model saved in ``directory`` (by ``save`` or ``ttt2la convert
    --out``): the recorded model (or a copy of ``model``, an unconverted module of the same
    architecture, or what ``factory`` — ``"pkg.module:function"`` or a callable — builds with
    the recorded keyword arguments), its weights, and the recorded conversion replayed and
    checked.

    A factory the manifest names is called only with ``trust_factory=True`` unless it is a
    bundled model: a checkpoint someone else made could name any function (as a Hugging Face
    directory's own code runs only with ``trust_remote_code=True``). Raises a
    ``CheckpointError`` naming the file for a missing file, an unknown manifest version, weights
    whose hash or shapes do not match the manifest, a factory not trusted, or a replay that
    differs. ``compile`` is ``convert``'s: a choice for this machine, not recorded.
    """
    from ..compiled_plan import compiler_backend
    from ..validation import check_flag
    from .arguments import as_directory

    directory = as_directory(directory)
    check_flag(trust_factory, "trust_factory")
    check_flag(trust_remote_code, "trust_remote_code")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: {'not a directory' if directory.exists() else 'no such directory'}")
    compiler_backend(compile)                   # refused before any file is read
    return _rebuild(directory, model, factory, trust_factory=trust_factory,
                    trust_remote_code=trust_remote_code, compile=compile)


def _rebuild(directory: Path, model, factory, *, trust_factory: bool, trust_remote_code: bool,
             compile) -> torch.nn.Module:
    """``load``'s work once its arguments are checked: read and check the files, build the
    model, fit the weights, replay the conversion and compare it with the recorded one."""
    from ..conversion import convert

    manifest = Manifest.read(directory)
    where = directory / MANIFEST_NAME
    tensors, weights = _checked_weights(directory, manifest)
    if model is None:
        model = _recorded_model(manifest, directory, factory, trust_factory=trust_factory,
                                trust_remote_code=trust_remote_code)
    else:
        from ..validation import check_model, copy_of

        check_model(model)
        model = copy_of(model)
    from .weights import fit_weights

    fit_weights(model, tensors, weights)
    args, kwargs = build_inputs(manifest.example_inputs, directory)
    folds = manifest.folds()
    converted = convert(model.eval(), level=manifest.level, example_inputs=args,
                        example_kwargs=kwargs, backend=manifest.backend, strict=manifest.strict,
                        inplace=True, compile=compile, **({"folds": folds} if folds else {}))
    diffs = replay_differences(manifest.report, converted.ttt2la_report.to_dict())
    if diffs:
        raise ManifestError(f"{where}: the replayed conversion differs from the recorded one "
                            f"({'; '.join(diffs)}): the model built here computes something "
                            "else than the one saved; build it with the arguments of the saved "
                            "model (model=, factory= or the recorded config)")
    return converted


def _checked_weights(directory: Path, manifest: Manifest) -> tuple[dict, Path]:
    """The weights the manifest names, read after checking every listed file is there and the
    weights' hash, names, dtypes and shapes are the recorded ones."""
    where = directory / MANIFEST_NAME
    weights = directory / manifest.weights["file"]
    for name in [*manifest.files, manifest.weights["file"]]:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory / name}: missing (named in {where})")
    if sha256_file(weights) != manifest.weights["sha256"]:
        raise WeightMismatchError(f"{weights}: its sha256 does not match {where}; the weights "
                                  "changed after they were written")
    tensors = read_weight_file(weights)
    recorded = {k: [str(v.dtype).split(".")[-1], list(v.shape)] for k, v in tensors.items()}
    if recorded != manifest.weights["tensors"]:
        raise ManifestError(f"{weights}: its tensors (names, dtypes, shapes) differ from those "
                            f"recorded in {where}")
    return tensors, weights


def _recorded_model(manifest: Manifest, directory: Path, factory, *, trust_factory: bool,
                    trust_remote_code: bool) -> torch.nn.Module:
    """The model the manifest's recipe builds (by the caller's ``factory`` when given)."""
    where = directory / MANIFEST_NAME
    recipe = Recipe.from_dict(manifest.recipe, where)
    if factory is not None:
        return recipe.with_factory(factory).build(directory, trust_factory=True)
    if recipe.kind == "module":
        raise CheckpointError(f"{where}: records no way to build {recipe.model_class}; pass "
                              f"model={recipe.model_class.rsplit('.', 1)[-1]}(...) to load")
    return recipe.build(directory, trust_remote_code=trust_remote_code,
                        trust_factory=trust_factory)


def check_reads_back(converted: torch.nn.Module, tmp: Path, out: Path, recipe: Recipe,
                      inputs: tuple[tuple, dict | None] | None) -> None:
    """Refuse to write a checkpoint ``load`` could not read back, or would read back as another
    function: the converted model must run on the recorded example inputs, and the checkpoint in
    ``tmp`` (renamed to ``out`` afterwards) must load and give the same outputs on them."""
    from ..errors import ConversionError
    from ..validation import check_runs

    try:
        if inputs is not None:
            check_runs(converted, *inputs)
        if recipe.kind == "module":             # load needs the caller's model= to rebuild it
            return
        loaded = _rebuild(tmp, None, None, trust_factory=True,
                          trust_remote_code=recipe.trust_remote_code, compile=None)
    except ConversionError as e:
        raise CheckpointError(f"directory {out}: not written, since load could not read it back: "
                              + str(e).replace(str(tmp), str(out))) from e
    if inputs is not None:
        _check_same_outputs(converted, loaded, inputs, out)


def _check_same_outputs(converted, loaded, inputs, out: Path) -> None:
    """Refuse a checkpoint whose reloaded model's outputs on the example inputs differ from the
    saved model's beyond the output dtype's tolerance for equal computations."""
    import torch.utils._pytree as pytree

    from ..testing import TOLERANCE, rel_rms_error

    args, kwargs = inputs
    with torch.no_grad():
        leaves = [[t for t in pytree.tree_leaves(m(*args, **(kwargs or {})))
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
                  for m in (converted, loaded)]
    errors = [rel_rms_error(b, a) if a.shape == b.shape else float("inf")
              for a, b in zip(*leaves)]
    bad = [f"output {i}: relative RMS {e:.3g}" for i, (e, a) in enumerate(zip(errors, leaves[0]))
           if not e <= TOLERANCE.get(a.dtype, 1e-5)]
    if bad or len(leaves[0]) != len(leaves[1]):
        raise CheckpointError(
            f"directory {out}: not written, since the model load would rebuild from it computes "
            f"something else on the example inputs ({'; '.join(bad) or 'other outputs'}); save "
            "with the factory and config that build this model")


__all__ = ["save", "load", "write_checkpoint", "check_reads_back", "open_checkpoint", "open_zoo",
           "Source",
           "Manifest", "Recipe", "CheckpointError", "UnsafeCheckpointError",
           "WeightMismatchError", "ManifestError", "MANIFEST_NAME",
           "MANIFEST_VERSION", "REPORT_NAME"]
