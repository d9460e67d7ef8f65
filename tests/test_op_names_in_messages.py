"""Refusals name an op in one vocabulary: the torch call the user writes and the user's line.

The layers other tests refuse — a stream read at a stride, an `if` on the loop's index, a table
longer than the sequence, outputs joined after another piece, a value of the loop read after it,
a size of no form in the length, a nonlinear update at every level — are refused again here, and
no message, no ``NonReducibleError.op`` and no verdict of ``inspect`` names an op by its aten
overload (``aten.mul.Tensor``): each names the torch call and the line that made it. A layer
whose loop is found but cannot run in parallel is inspected too, its verdicts named so.
"""
from __future__ import annotations

import pytest
import torch

import ttt2la
from test_frontend_styles import StateGatedLayer, TanhFinalLayer
from test_refusal_messages import (ArgumentsOfTheLength, FromTokenOne, JoinedAfterAZeroRow,
                                   RateTable, ReadAfterTheLoop, ResetEveryFewChunks,
                                   SizeOfNoForm, TwoTokensPerStep, UpdateEveryFewTokens)
from ttt2la.zoo.ttt_linear import TTTLinearFuncGradLayer

#: id -> (the refused layer, the example's shape, the levels it is refused at)
REFUSED = {
    "from_token_one": (FromTokenOne, (2, 16, 8), (0,)),
    "stride": (TwoTokensPerStep, (2, 12, 8), (0,)),
    "if_on_token_index": (UpdateEveryFewTokens, (2, 24, 8), (0,)),
    "if_on_chunk_index": (ResetEveryFewChunks, (2, 24, 8), (0,)),
    "longer_table": (lambda: RateTable("in_loop"), (2, 16, 8), (0,)),
    "joined_after_a_piece": (lambda: JoinedAfterAZeroRow("list"), (2, 17, 8), (0,)),
    "read_after_the_loop": (ReadAfterTheLoop, (2, 16, 8), (0,)),
    "size_of_no_form": (SizeOfNoForm, (2, 16, 8), (0,)),
    "arguments_of_the_length": (ArgumentsOfTheLength, (2, 16, 8), (0,)),
    "nonlinear_final_layer": (TanhFinalLayer, (2, 11, 6), (0, 1, 2)),
    "state_dependent_rate": (StateGatedLayer, (2, 11, 6), (0, 1, 2)),
    "layer_norm_in_the_loss": (lambda: TTTLinearFuncGradLayer(8, 2, 4), (2, 14, 8), (0, 1, 2)),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_no_refusal_names_an_op_by_its_aten_overload(name):
    make, shape, levels = REFUSED[name]
    torch.manual_seed(0)
    layer, x = make(), torch.randn(*shape)
    for level in levels:
        with pytest.raises(ttt2la.ConversionError) as refused:
            ttt2la.convert(layer, level=level, example_inputs=(x,))
        message = str(refused.value)
        assert "aten." not in message and "aten::" not in message, message
        assert "test_refusal_messages.py:" in message or "test_frontend_styles.py:" in message \
            or "ttt_linear.py:" in message, message
        op = getattr(refused.value, "op", None)
        assert op is None or (op.startswith("`") and "aten" not in op), op
    if isinstance(refused.value, ttt2la.NonReducibleError):   # its loop is found: inspect it
        verdicts = ttt2la.inspect(layer, example_inputs=(x,), show=False).layers[0].levels
        for level in levels:
            assert verdicts[level].startswith("recurrent: `"), verdicts[level]
            assert "aten." not in verdicts[level], verdicts[level]
