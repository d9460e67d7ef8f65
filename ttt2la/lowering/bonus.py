"""A read of the state plus the token's own key-value product: RWKV's bonus.

RWKV-5 and RWKV-6 read their memory before writing the token into it, and add that token's own
product weighted per key channel by a learnt ``u``: ``o_t = r_t (S_{t-1} + diag(u) k_tᵀ v_t)``.
A product distributes over the sum, so the read is the token-causal op's read of ``S`` plus one
dot product per token, ``((r_t ⊙ u) · k_t) v_t``, computed for every token at once — never the
``[Dk, Dv]`` outer product per token the code as written builds. The term may be any outer
product of one token's column and row, times factors that hold one number per matrix, per row
or per column; anything else keeps the generic plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .affine_update import is_vector_factor, per_matrix

aten = torch.ops.aten


@dataclass(frozen=True)
class Bonus:
    """The term ``c · Π scales ⊙ (left ⊗ right)`` added to the state where the loop reads it:
    ``scales`` node factors (their values follow the term's column and row among the lifted
    features), ``constant`` the product of its constant factors."""

    constant: float
    scales: int

    @property
    def outputs(self) -> int:
        """How many feature outputs it takes: its column, its row and its factors."""
        return 2 + self.scales


def state_plus_term(operand, w_ref: set, state_dep: set, strip):
    """``(state, term)`` when ``operand`` is a state of ``w_ref`` plus a term no live state
    feeds, as the loop reads it; else ``None``."""
    base = strip(operand)
    if not isinstance(base, torch.fx.Node) or base.target is not aten.add.Tensor \
            or base.kwargs or len(base.args) != 2:
        return None
    for x, term in (base.args, base.args[::-1]):
        if strip(x) in w_ref and isinstance(term, torch.fx.Node) and term not in state_dep:
            return strip(x), term
    return None


def bonus_of(term: torch.fx.Node, state_dep: set, contraction) -> tuple[Bonus, list] | None:
    """The ``Bonus`` a term is and the feature nodes it reads (column, row, node factors), when
    it is one token's outer product (broadcast, or a ``bmm`` of a column and a row) times
    factors (``contraction`` reads it); else ``None``."""
    con = contraction(term, state_dep, is_vector_factor)
    if con is None or not (con.outer or _one_token(con.left)):
        return None
    constant, nodes = 1.0, []
    for s in con.scales:
        if isinstance(s, torch.fx.Node):
            nodes.append(s)
        else:
            constant *= s
    return Bonus(constant, len(nodes)), [con.left, con.right, *nodes]


def _one_token(left: torch.fx.Node) -> bool:
    """Whether a ``bmm``'s left operand ``[b, rows, T]`` holds one token: an outer product."""
    val = left.meta.get("val") if isinstance(left, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == 1


def bonus_read(bonus: Bonus, phi_q: torch.Tensor, features: list, w_shape: tuple,
               transposed: bool) -> torch.Tensor:
    """The term as read, ``((φ(q) ⊙ key weights) · key) (value ⊙ value weights)``, ``[N, b, 1,
    Dv]`` beside the op's read of the state: ``phi_q [N, b, 1, Dk]``; ``features`` the term's
    column, row and factors as the lifted features computed them (``[N, ...]``); ``w_shape``
    the state's traced layout (``transposed``: ``[.., Dv, Dk]``)."""
    left, right, *scales = features
    N, b = phi_q.shape[:2]
    batch, rows, cols = tuple(w_shape[:-2]), w_shape[-2], w_shape[-1]
    left = left.reshape(N, b, rows, 1)
    right = right.reshape(N, b, 1, cols)
    row_w = phi_q.new_ones(()) * bonus.constant
    col_w = phi_q.new_ones(())
    for s in scales:
        axis = tuple(s.shape[-2:]) if s.dim() >= 2 else (1, 1)
        if axis[0] > 1:
            row_w = row_w * per_matrix(s, batch, (rows, 1)).reshape(N, b, rows, 1)
        else:
            matrix = (1, cols) if axis[-1] > 1 else (1, 1)
            col_w = col_w * per_matrix(s, batch, matrix).reshape(N, b, *matrix)
    # the key runs along the state's rows, or along its columns when it is stored transposed
    if transposed:
        key, value = right * col_w, (left * row_w).transpose(-1, -2)
    else:
        key, value = (left * row_w).transpose(-1, -2), right * col_w
    return (phi_q * key).sum(-1, keepdim=True) * value


__all__ = ["Bonus", "bonus_of", "bonus_read", "state_plus_term"]
