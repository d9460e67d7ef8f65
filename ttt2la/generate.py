"""Sampling from a converted language model, one token per call, the fast weights carried along.

``generate`` feeds the prompt once, then each sampled token alone, through ``ttt2la.Stream``:
the converted TTT layers continue from the state the previous call left instead of re-reading
the sequence, so every step costs one token (plus the open chunk a chunked layer recomputes).
Byte-level models (a vocabulary of 256) read and write text; others take and give token ids.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .validation import InvalidInputError
from .drift import vocabulary_size
from .stream import Stream

BYTE_VOCABULARY = 256


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def check_temperature(temperature) -> None:
    """Refuse a sampling temperature that is not a finite number >= 0 (NaN or infinity would
    only fail deep in sampling, or sample nonsense)."""
    import math

    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise InvalidInputError(f"temperature must be a finite number >= 0 (0 is greedy), got "
                                f"{temperature!r}")


def sample_tokens(model: torch.nn.Module, prompt: torch.Tensor, n_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, seed: int = 0
                  ) -> Iterator[int]:
    """Yield ``n_tokens`` token ids sampled after ``prompt`` (1-D ids); ``temperature=0`` is
    greedy decoding."""
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise InvalidInputError("the prompt must be a non-empty 1-D sequence of token ids")
    vocab = vocabulary_size(model)
    if vocab is None:
        raise InvalidInputError(
            f"{type(model).__name__} has no token embedding, so it is no language model to "
            "sample from: generate takes a converted checkpoint of a model that maps token ids "
            "to logits (a converted layer alone takes features)")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise InvalidInputError(f"the prompt holds token ids outside the model's vocabulary "
                                f"0..{vocab - 1}")
    check_temperature(temperature)
    gen = torch.Generator().manual_seed(seed)
    stream = Stream(model)
    with torch.no_grad():
        logits = _logits(stream.stream(prompt[None].long()))[0, -1]
        for _ in range(n_tokens):
            token = _pick(logits.float(), temperature, top_k, gen)
            yield token
            logits = _logits(stream.stream(torch.tensor([[token]])))[0, -1]


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
          gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        cut = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=gen))


def check_byte_model(model: torch.nn.Module) -> None:
    """Refuse a text prompt for a model whose tokens are not bytes (a vocabulary of 256)."""
    if vocabulary_size(model) != BYTE_VOCABULARY:
        raise InvalidInputError("text prompts need a byte-level model (a vocabulary of 256); "
                                "pass token ids instead")


def generate_text(model: torch.nn.Module, prompt: str, n_tokens: int, *,
                  on_token: Callable[[str], None] | None = None, **sampling) -> str:
    """Continue ``prompt`` with a byte-level model; ``on_token`` sees each new piece of text."""
    from .zoo.trained import decode, encode

    check_byte_model(model)
    pending, out = b"", []
    for token in sample_tokens(model, encode(prompt), n_tokens, **sampling):
        pending += bytes([token])
        try:
            piece = pending.decode("utf-8")
        except UnicodeDecodeError:
            if len(pending) < 4:       # an incomplete multi-byte character: wait for the rest
                continue
            piece = decode(torch.tensor(list(pending)))
        pending = b""
        out.append(piece)
        if on_token is not None:
            on_token(piece)
    return "".join(out)


__all__ = ["check_temperature", "check_byte_model", "sample_tokens", "generate_text",
           "vocabulary_size"]
