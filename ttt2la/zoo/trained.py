"""A trained character-level LaCT language model, and the text it was trained and validated on.

The text is the Python standard library's own source files, which every Python install has, so
the demo needs no download. Tokens are the files' UTF-8 bytes (a fixed vocabulary of 256), files
joined by a NUL byte. The split is by file and decided by a seeded hash of the file's path
relative to the standard library, so a file is held out on every install that has it, whatever
other files that install has. The weights ship with the package as safetensors (never pickle),
beside a JSON card that names the factory, its keyword arguments and the training facts.
"""
from __future__ import annotations

import importlib
import json
import math
import sysconfig
import zlib

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

#: Where the committed checkpoints live (package data).
WEIGHTS_DIR = Path(__file__).parent / "weights"
#: One file in this many is held out for validation.
HOLD_OUT_ONE_IN = 10
#: Seed of the train/validation split.
SPLIT_SEED = 0
#: Byte joining two files in the token stream.
FILE_SEPARATOR = 0
VOCAB_SIZE = 256


# -- text ----------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    """The directory of this Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[str]:
    """Paths (relative, '/'-separated, sorted) of the standard library's ``.py`` files;
    installed third-party packages are left out."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel or not path.is_file():
            continue
        found.append(rel)
    return sorted(found)


def is_held_out(relpath: str, seed: int = SPLIT_SEED) -> bool:
    """Whether the file at ``relpath`` (relative to the standard library) is a validation file."""
    return zlib.crc32(f"{seed}:{relpath}".encode()) % HOLD_OUT_ONE_IN == 0


def split_stdlib(root: Path | None = None, seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """``(train, validation)``: the standard library's source files, split by file."""
    files = stdlib_sources(root)
    return ([f for f in files if not is_held_out(f, seed)],
            [f for f in files if is_held_out(f, seed)])


def encode(text: str | bytes) -> torch.Tensor:
    """Token ids of ``text``: its UTF-8 bytes, as a 1-D ``int64`` tensor."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return _bytes_tensor(data).long()


def decode(ids: torch.Tensor) -> str:
    """Text of token ids (bytes that are not valid UTF-8 become U+FFFD)."""
    return bytes(int(i) for i in ids.reshape(-1).tolist()).decode("utf-8", errors="replace")


def read_tokens(files: list[str], root: Path | None = None) -> torch.Tensor:
    """The files' bytes joined by ``FILE_SEPARATOR``, as one 1-D ``uint8`` tensor."""
    root = Path(root) if root is not None else stdlib_root()
    parts = []
    for rel in files:
        parts.append((root / rel).read_bytes())
    return _bytes_tensor(bytes([FILE_SEPARATOR]).join(parts))


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a 1-D ``uint8`` tensor (``torch.frombuffer`` refuses an empty buffer)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def validation_sequences(n: int, length: int, root: Path | None = None,
                         seed: int = SPLIT_SEED) -> torch.Tensor:
    """``[n, length + 1]`` token ids from the held-out files, at evenly spaced offsets of their
    joined stream (deterministic: the same rows on every call). Column ``t + 1`` is the target
    of column ``t``."""
    _, validation = split_stdlib(root, seed)
    return _spaced_rows(read_tokens(validation, root), n, length + 1, "held-out")


def training_sequences(n: int, length: int, root: Path | None = None, seed: int = SPLIT_SEED,
                       files: int = 32) -> torch.Tensor:
    """``[n, length]`` token ids from the first ``files`` training files (sorted): text the model
    was trained on, for calibrating a conversion without touching the held-out text."""
    train, _ = split_stdlib(root, seed)
    return _spaced_rows(read_tokens(sorted(train)[:files], root), n, length, "training")


def _spaced_rows(stream: torch.Tensor, n: int, span: int, what: str) -> torch.Tensor:
    if stream.numel() < n * span:
        raise ValueError(f"the {what} standard library files have {stream.numel():,} bytes, "
                         f"fewer than {n} sequences of {span}")
    starts = torch.linspace(0, stream.numel() - span, n).long().tolist()
    return torch.stack([stream[s: s + span] for s in starts]).long()


# -- loss ----------------------------------------------------------------------------------------
def next_token_loss(model: Callable[[torch.Tensor], torch.Tensor], sequences: torch.Tensor,
                    batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats per byte) of ``model`` on ``sequences`` ``[n, L + 1]``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for rows in sequences.split(batch):
            logits = model(rows[:, :-1])
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                     rows[:, 1:].reshape(-1), reduction="sum").item()
            count += rows[:, 1:].numel()
    return total / count


def unigram_loss(sequences: torch.Tensor) -> float:
    """The cross-entropy (nats per byte) of the best unigram model of the targets of
    ``sequences``: their own byte frequencies, fit on the very text it is scored on."""
    counts = torch.bincount(sequences[:, 1:].reshape(-1), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


# -- the committed checkpoint --------------------------------------------------------------------
@dataclass
class TrainedModel:
    """A committed checkpoint: the model (eval mode), its tokenizer and its card."""

    model: torch.nn.Module
    card: dict
    encode: Callable[[str | bytes], torch.Tensor] = encode
    decode: Callable[[torch.Tensor], str] = decode

    @property
    def sequence_length(self) -> int:
        """The sequence length the model was trained at."""
        return int(self.card["training"]["sequence_length"])

    def validation_sequences(self, n: int, length: int | None = None) -> torch.Tensor:
        """``n`` held-out sequences of ``length`` tokens (default: the training length) plus one
        target each, from the split the model was trained with."""
        return validation_sequences(n, length or self.sequence_length,
                                    seed=int(self.card["data"]["split_seed"]))

    def calibration_sequences(self, n: int, length: int | None = None) -> torch.Tensor:
        """``n`` sequences of training text (never held-out text) to calibrate conversions on."""
        return training_sequences(n, length or self.sequence_length,
                                  seed=int(self.card["data"]["split_seed"]))


def resolve_factory(spec: str) -> Callable[..., torch.nn.Module]:
    """``"pkg.module:name"`` -> the object it names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"a factory is written 'pkg.module:name', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def load_card(name: str = "char_lm", directory: Path | None = None) -> dict:
    """The JSON card of the committed checkpoint ``name``."""
    directory = Path(directory) if directory is not None else WEIGHTS_DIR
    return json.loads((directory / f"{name}.json").read_text())


def trained_char_lm(name: str = "char_lm", directory: Path | None = None) -> TrainedModel:
    """The committed character-level LaCT language model, loaded from safetensors, in eval mode."""
    from safetensors.torch import load_model

    directory = Path(directory) if directory is not None else WEIGHTS_DIR
    card = load_card(name, directory)
    kwargs = json.loads((directory / card["config"]).read_text())
    model = resolve_factory(card["factory"])(**kwargs)
    load_model(model, str(directory / card["weights"]), strict=True)
    return TrainedModel(model.eval(), card)


def perplexity(loss: float) -> float:
    """``exp(loss)``, the perplexity of a loss in nats."""
    return math.exp(loss)


__all__ = ["TrainedModel", "trained_char_lm", "load_card", "resolve_factory", "stdlib_root",
           "stdlib_sources", "is_held_out", "split_stdlib", "encode", "decode", "read_tokens",
           "training_sequences",
           "validation_sequences", "next_token_loss", "unigram_loss", "perplexity", "WEIGHTS_DIR",
           "VOCAB_SIZE"]
