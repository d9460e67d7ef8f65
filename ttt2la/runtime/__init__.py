"""Chunk-parallel linear-attention runtime that recognized TTT loops lower to."""
from ttt2la.runtime.bidirectional import (bidirectional_linear_attention,
                                          naive_bidirectional_linear_attention)
from ttt2la.runtime.delta_rule import delta_rule, naive_delta_rule
from ttt2la.runtime.dispatch import (block_linear_attention, chunk_linear_attention,
                                     implementation_name)
from ttt2la.runtime.matrix_affine_scan import matrix_affine_scan
from ttt2la.runtime.naive import (RuntimeInputError, naive_block_linear_attention,
                                  naive_chunk_linear_attention)
from ttt2la.runtime.newton_schulz import newton_schulz
from ttt2la.runtime.scan import affine_scan, prefix_sum

__all__ = ["block_linear_attention", "chunk_linear_attention", "implementation_name",
           "naive_block_linear_attention", "naive_chunk_linear_attention", "newton_schulz",
           "affine_scan", "prefix_sum", "delta_rule", "naive_delta_rule", "matrix_affine_scan",
           "bidirectional_linear_attention", "naive_bidirectional_linear_attention",
           "RuntimeInputError"]
