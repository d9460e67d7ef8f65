"""The embedding a model starts with, from which token-id example inputs can be made up."""
from __future__ import annotations

import torch


def first_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The embedding the model starts with: the first module without submodules that holds
    parameters, if it is one. A parameter held beside submodules (a learned positional
    embedding ``self.pos`` on the model itself) is added to what they compute, so it does not
    decide what the model takes."""
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m
        leaf = next(m.children(), None) is None
        if leaf and any(True for _ in m.parameters(recurse=False)):
            return None
    return None


__all__ = ["first_embedding"]
