"""A tiny pre-norm language model whose token mixers are LaCT layers (no attention), for tests and demos."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lact_folded import LaCTFoldedLayer
from .lact_heads import LaCTHeadsLayer
from .lact_published import LaCTPublishedLayer
from .variants import with_variant

LACT_STYLES = {"folded": LaCTFoldedLayer, "heads": LaCTHeadsLayer, "published": LaCTPublishedLayer}


class SwiGLUMLP(nn.Module):
    """Feed-forward block ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Residual block: ``x + ttt(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, ttt: nn.Module, d_model: int, mlp_hidden: int):
        super().__init__()
        self.ttt_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.ttt = ttt
        self.mlp_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.mlp = SwiGLUMLP(d_model, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ttt(self.ttt_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLaCTLM(nn.Module):
    """Embedding, ``n_layers`` LaCT blocks, final RMSNorm and an LM head (tied to the embedding by default).

    ``style`` picks the LaCT implementation ("folded", "heads" or "published"); ``layer_kwargs`` go to every LaCT layer,
    and ``variant=k`` builds them as LaCT variant k (steps 1..k of the paper's simplifications).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        num_heads: int,
        chunk_size: int,
        *,
        style: str = "folded",
        tie_embeddings: bool = True,
        mlp_ratio: int = 4,
        variant: int | None = None,
        **layer_kwargs,
    ):
        super().__init__()
        if style not in LACT_STYLES:
            raise ValueError(f"unknown LaCT style {style!r}; choose one of {sorted(LACT_STYLES)}")
        layer_cls = LACT_STYLES[style]
        layer_kwargs = with_variant(variant, layer_kwargs)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(layer_cls(d_model, num_heads, chunk_size, **layer_kwargs), d_model, mlp_ratio * d_model)
            for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(d_model, eps=1e-6)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B, L] token ids -> logits [B, L, vocab_size]."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))
