"""Weights on disk: reading them safely, hashing them, fitting them to a model and writing them.

Pickled checkpoints (``.pt``, ``.bin``) are read with ``torch.load(weights_only=True)``, whose
unpickler builds tensors and plain containers only: a file that names anything else (code that
would run on loading) is refused, never unpickled. Safetensors files hold tensors only.
"""
from __future__ import annotations

import hashlib
import json
import pickle
import re
import warnings

from pathlib import Path

import torch

from .errors import CheckpointError, UnsafeCheckpointError, WeightMismatchError

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
#: Keys under which training scripts commonly nest a state dict in a pickled checkpoint.
NESTED_KEYS = ("state_dict", "model", "model_state_dict")


def weight_files(path: Path) -> list[Path]:
    """The files holding the weights of ``path``: itself, or a model directory's weight file(s).

    A directory holds ``model.safetensors``, or shards named by ``model.safetensors.index.json``,
    or a ``pytorch_model.bin``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file():
        return [path]
    if (path / SAFETENSORS_INDEX).is_file():
        return _shards(path / SAFETENSORS_INDEX)
    for name in (SAFETENSORS_NAME, "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
    raise CheckpointError(f"{path}: a directory without weights (expected {SAFETENSORS_NAME}, "
                          f"{SAFETENSORS_INDEX} with its shards, or pytorch_model.bin)")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a readable shard index ({_why(e)})") from e
    files = []
    for name in names:
        shard = (index.parent / name)
        if not isinstance(name, str) or shard.resolve().parent != index.parent.resolve():
            raise CheckpointError(f"{index}: shard {name!r} is not a file beside the index")
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard named by {index.name} is missing")
        files.append(shard)
    return files


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint ``path`` (a file or a model directory), by name, on the CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        for name, t in read_weight_file(file).items():
            if name in tensors:
                raise CheckpointError(f"{file}: tensor {name!r} is also in another shard")
            tensors[name] = t
    return tensors


def read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` or pickled (``.pt``/``.pth``/``.bin``) file."""
    file = Path(file)
    if file.suffix == ".safetensors":
        return _read_safetensors(file)
    if file.suffix in PICKLE_SUFFIXES:
        return _read_pickled(file)
    raise CheckpointError(f"{file}: unknown weight file type {file.suffix!r} (expected "
                          f".safetensors, {', '.join(PICKLE_SUFFIXES)} or a model directory)")


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({_why(e)})") from e
    except Exception as e:       # safetensors raises its own error type for corrupt files
        raise CheckpointError(f"{file}: not a valid safetensors file, truncated or corrupt "
                              f"({_why(e)})") from e


def _read_pickled(file: Path) -> dict[str, torch.Tensor]:
    try:
        with warnings.catch_warnings():      # torch warns about pickle protocols it may not read
            warnings.simplefilter("ignore")
            data = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if _not_a_pickle(e):
            raise CheckpointError(f"{file}: not a torch checkpoint (neither a zip archive nor a "
                                  "pickle torch.load reads); name a .safetensors, .pt or .bin "
                                  "file of weights") from e
        raise UnsafeCheckpointError(
            f"{file}: refused, this pickle would run code to load (it names objects other than "
            f"tensors{_unpickler_global(e)}); if you trust it, re-save its tensors with "
            "safetensors.torch.save_file") from e
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({_why(e)})") from e
    except Exception as e:       # truncated zip archives, bad magic numbers ...
        raise CheckpointError(f"{file}: not a readable torch checkpoint, truncated or corrupt "
                              f"({_why(e).splitlines()[0]})") from e
    for key in NESTED_KEYS:
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()):
        raise CheckpointError(f"{file}: holds a {type(data).__name__}, not a state dict of "
                              "named tensors")
    return data


def _not_a_pickle(e: BaseException) -> bool:
    """Whether torch's safe unpickler refused the bytes themselves (an opcode or length no
    pickle of tensors holds), not a pickle naming code."""
    return re.search(r"WeightsUnpickler error:\s*(Unsupported operand|String is too long)",
                     str(e)) is not None


def _unpickler_global(e: BaseException) -> str:
    """``": GLOBAL io.open"``: what the refused pickle names, from torch's unpickler message."""
    found = re.search(r"Unsupported global: (GLOBAL [\w.]+)", str(e))
    return f": {found.group(1)}" if found else ""


def _why(e: BaseException) -> str:
    return str(getattr(e, "strerror", None) or e) or type(e).__name__


# -- hashing ------------------------------------------------------------------------------------
def sha256_file(file: Path) -> str:
    """The sha256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    try:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({_why(e)})") from e
    return digest.hexdigest()


def sha256_files(files: list[Path], root: Path | None = None) -> dict:
    """``{"files": {name: sha256}, "sha256": <sha256 of those, in order>}`` for weight files."""
    named = {str(f.relative_to(root) if root else f.name): sha256_file(f) for f in files}
    combined = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in named.items()).encode())
    return {"files": named, "sha256": combined.hexdigest()}


def sha256_state(state: dict[str, torch.Tensor]) -> str:
    """A sha256 of a state dict's names, dtypes, shapes and values (for weights held in memory)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


# -- fitting and writing ------------------------------------------------------------------------
def alias_groups(model: torch.nn.Module) -> list[list[str]]:
    """The model's state-dict names grouped by the tensor they hold (tied weights share one)."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def fit_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Load ``tensors`` (read from ``where``) into ``model``, refusing anything that does not fit.

    A tied weight may be stored under any one of its names. Missing, unexpected and mis-shaped
    tensors are all listed in one ``WeightMismatchError`` naming ``where``.
    """
    full, problems = _fitted(model, tensors)
    if problems:
        raise WeightMismatchError(f"{where}: the weights do not fit {type(model).__name__} "
                                  f"({'; '.join(problems)})")
    model.load_state_dict(full, strict=True)


def weight_problems(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What keeps ``tensors`` from loading into ``model`` (shapes only): ``[]`` when they fit."""
    return _fitted(model, tensors)[1]


def _fitted(model: torch.nn.Module, tensors: dict) -> tuple[dict, list[str]]:
    """``tensors`` under every name of the model's tied weights, and the missing, unexpected,
    mis-shaped and wrongly tied ones, described (weights the model ties, given distinct, would
    otherwise all load the first one: another model, silently)."""
    expected = model.state_dict()
    full, missing, seen, untied = {}, [], set(), []
    for names in alias_groups(model):
        present = [n for n in names if n in tensors]
        if not present:
            missing += names
            continue
        if any(not torch.equal(tensors[present[0]], tensors[n]) for n in present[1:]):
            untied.append(" and ".join(present))
        seen.update(present)
        full.update((n, tensors[present[0]]) for n in names)
    unexpected = sorted(set(tensors) - seen)
    shapes = [f"{n}: file {tuple(t.shape)}, model {tuple(expected[n].shape)}"
              for n, t in full.items() if tuple(t.shape) != tuple(expected[n].shape)]
    kinds = [f"{n}: file {t.dtype}, model {expected[n].dtype}"
             for n, t in full.items() if _kind(t.dtype) != _kind(expected[n].dtype)]
    return full, ([f"missing {_few(missing)}"] if missing else []) + \
        ([f"unexpected {_few(unexpected)}"] if unexpected else []) + \
        ([f"mis-shaped {_few(shapes)}"] if shapes else []) + \
        ([f"of another kind of number, which loading would truncate or reinterpret: "
          f"{_few(kinds)}"] if kinds else []) + \
        ([f"tied in the model but given different values: {_few(untied)}"] if untied else [])


def _kind(dtype: torch.dtype) -> str:
    """A dtype's kind of number: loading casts within a kind (an fp16 file into fp32 weights,
    as ``load_state_dict`` does) but not across kinds (integers into floats lose everything
    after the point)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _few(items: list[str], n: int = 4) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each tied tensor once, under its first name, contiguous."""
    state = model.state_dict()
    return {names[0]: state[names[0]].detach().cpu().contiguous()
            for names in alias_groups(model)}


def write_weights(model: torch.nn.Module, file: Path) -> None:
    """Write the model's weights as safetensors under their original names (tied tensors once)."""
    from safetensors.torch import save_file

    save_file(unique_state(model), str(file), metadata={"format": "pt"})


__all__ = ["weight_files", "read_weights", "read_weight_file", "sha256_file", "sha256_files",
           "sha256_state", "alias_groups", "fit_weights", "unique_state", "write_weights"]
