"""The errors of reading, writing and reloading checkpoints: each names the file it is about."""
from __future__ import annotations

from ..errors import ConversionError


class CheckpointError(ConversionError):
    """A checkpoint could not be read, written or rebuilt: a missing or unreadable file, weights
    that do not fit the model, a model recipe that cannot be followed, an output path refused."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint would run code to load: a pickle that names something other than tensors,
    or a manifest naming a factory the caller has not trusted. ttt2la refuses it rather than
    run that code."""


class WeightMismatchError(CheckpointError):
    """Weights do not fit the model they are loaded into (missing, unexpected or mis-shaped
    tensors), or no longer match the hash recorded when they were written."""


class ManifestError(CheckpointError):
    """A converted checkpoint's manifest (``ttt2la.json``) is missing, malformed, of an unknown
    version, or disagrees with the conversion replayed from it."""




def read_json(path, error: type[CheckpointError] = CheckpointError):
    """The JSON document in ``path``; an unreadable or malformed file raises ``error`` naming
    it."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from e
    except ValueError as e:
        raise error(f"{path}: not JSON ({e})") from e
    except RecursionError as e:
        raise error(f"{path}: not a JSON document ttt2la reads (nested too deeply)") from e


__all__ = ["CheckpointError", "UnsafeCheckpointError", "WeightMismatchError", "ManifestError",
           "read_json"]
