"""Example inputs as data: a spec recorded in the manifest, from which ``load`` rebuilds the
exact tensors the conversion ran on.

Specs: ``{"kind": "token_ids", "shape": [B, L], "vocab_size": V, "seed": s}`` (uniform ids),
``{"kind": "normal", "shape": [B, L, D], "dtype": "float32", "seed": s}``, ``{"kind": "zoo",
"name": ..., "batch": B, "length": L, "seed": s}``, ``{"kind": "file", "file": NAME, "sha256":
...}`` (tensors kept beside the weights) and ``{"kind": "inferred"}`` (``convert`` chose them).

An inputs file is a safetensors file whose tensors named ``0``, ``1``, ... are the positional
arguments in that order, and any other names keyword arguments.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..embedding import first_embedding
from .errors import CheckpointError, ManifestError
from .weights import read_weight_file, sha256_file

INPUTS_NAME = "example_inputs.safetensors"


def spec_from_shape(model: torch.nn.Module, shape: tuple[int, ...], seed: int = 0) -> dict:
    """The spec of ``--example-shape``: ``B,L`` token ids for a model that starts with an
    embedding, ``B,L,D`` standard-normal features otherwise."""
    emb = first_embedding(model)
    if len(shape) == 2 and emb is not None:
        return {"kind": "token_ids", "shape": list(shape), "vocab_size": emb.num_embeddings,
                "seed": seed}
    if len(shape) == 3:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
        return {"kind": "normal", "shape": list(shape), "dtype": str(dtype).split(".")[-1],
                "seed": seed}
    wanted = "B,L (token ids) or B,L,D (features)" if emb is not None else \
        f"B,L,D: {type(model).__name__} does not start with an embedding, so give the width"
    raise CheckpointError(f"--example-shape {','.join(map(str, shape))}: expected {wanted}")


#: The kinds of example-input spec ``build_inputs`` rebuilds.
INPUT_KINDS = ("token_ids", "normal", "zoo", "file", "inferred")


def build_inputs(spec: dict, directory: Path | None = None) -> tuple[tuple | None, dict | None]:
    """``(example_inputs, example_kwargs)`` rebuilt from ``spec`` (``None`` for inferred ones)."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    try:
        if kind == "inferred":
            return None, None
        if kind == "token_ids":
            gen = torch.Generator().manual_seed(int(spec["seed"]))
            return (torch.randint(0, int(spec["vocab_size"]), tuple(spec["shape"]),
                                  generator=gen),), None
        if kind == "normal":
            gen = torch.Generator().manual_seed(int(spec["seed"]))
            return (torch.randn(tuple(spec["shape"]), generator=gen,
                                dtype=getattr(torch, spec["dtype"])),), None
        if kind == "zoo":
            from ..cli import ZOO

            return ZOO[spec["name"]].example_inputs(int(spec["batch"]), int(spec["length"]),
                                                    int(spec["seed"])), None
        if kind == "file":
            path = Path(directory or ".") / spec["file"]
            if not path.is_file():
                raise CheckpointError(f"{path}: the example inputs file is missing")
            if spec.get("sha256") and sha256_file(path) != spec["sha256"]:
                raise CheckpointError(f"{path}: the example inputs changed since they were "
                                      "recorded (sha256 differs)")
            return read_inputs(path)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        where = f"{Path(directory) / 'ttt2la.json'}: " if directory is not None else ""
        raise (ManifestError if where else CheckpointError)(
            f"{where}malformed example-input spec {spec!r} ({type(e).__name__}: {e}); "
            "convert the source checkpoint again") from e
    raise CheckpointError(f"unknown example-input spec kind {kind!r}")


def read_inputs(path: Path) -> tuple[tuple, dict | None]:
    """Positional and keyword example inputs from a safetensors file (see the module docstring)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: example inputs must be a .safetensors file")
    tensors = read_weight_file(path)
    positional = sorted((k for k in tensors if k.isdigit()), key=int)
    if [int(k) for k in positional] != list(range(len(positional))):
        raise CheckpointError(f"{path}: positional inputs must be named 0, 1, ... without gaps "
                              f"(found {', '.join(positional)})")
    kwargs = {k: v for k, v in tensors.items() if not k.isdigit()}
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors")
    return tuple(tensors[k] for k in positional), kwargs or None


def write_inputs(args: tuple, kwargs: dict | None, path: Path) -> None:
    """Store example inputs (tensors only) in the format ``read_inputs`` reads."""
    from safetensors.torch import save_file

    tensors = {str(i): a for i, a in enumerate(args)}
    tensors.update(kwargs or {})
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: only tensor example inputs can be stored (argument(s) "
                              f"{', '.join(bad)} are not tensors)")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


def describe(spec: dict) -> str:
    """A few words for the report: what the example inputs were."""
    kind = spec.get("kind")
    if kind == "token_ids":
        return f"token ids of shape {tuple(spec['shape'])}, seed {spec['seed']}"
    if kind == "normal":
        return f"standard-normal {spec['dtype']} features of shape {tuple(spec['shape'])}, " \
               f"seed {spec['seed']}"
    if kind == "zoo":
        return f"the bundled {spec['name']} inputs, {spec['batch']}x{spec['length']}, " \
               f"seed {spec['seed']}"
    if kind == "file":
        return f"the tensors in {spec['file']}"
    return "inferred by ttt2la.convert"


__all__ = ["INPUTS_NAME", "first_embedding", "spec_from_shape", "build_inputs", "read_inputs",
           "write_inputs", "describe"]
