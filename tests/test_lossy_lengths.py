"""A lossy conversion runs its plan at untraced lengths where the code decides as at the traced ones.

A lossy conversion cannot check a new length against the code as written (that computes another
function), so where the code computes Python values of the length it held the lengths it was
traced at only. LaCT's language-model layer builds its rotary table for
``max(L, max_position_embeddings)`` positions (2048 as released): converted at level 2, every
other length was refused. The run that finds such values records each decision as a function of
the length; where every one takes, at a new length, the value it takes at every traced shape,
the code takes the traced path there and the plan runs. Elsewhere, and where a use was read off
the source only or is a number passed to torch, the length is refused as before.
"""
from __future__ import annotations

import pytest
import torch

import ttt2la
from ttt2la.frontend.length_values import LengthValue
from ttt2la.length_vouching import LengthVouching
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTRotaryLayer

FP32 = TOLERANCE[torch.float32]
D, H, C, EXAMPLE, POSITIONS = 64, 2, 16, 64, 96


@pytest.fixture(scope="module")
def lact():
    torch.manual_seed(0)
    kw = dict(muon=False, max_position_embeddings=POSITIONS)
    layer = LaCTRotaryLayer(D, H, C, **kw).eval()
    variant2 = LaCTRotaryLayer(D, H, C, update_theta=False, weight_norm=False, **kw).eval()
    variant2.load_state_dict(layer.state_dict())
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, EXAMPLE, D),))
    return converted, variant2


@pytest.mark.parametrize("length", [C, 40, 80, POSITIONS - 1])
def test_lengths_where_the_code_decides_alike_run_the_plan(lact, length):
    converted, variant2 = lact
    x = torch.randn(1, length, D)
    with torch.no_grad():
        assert rel_rms_error(converted(x), variant2(x)) <= FP32
    runs = converted.ttt2la_report.layers[0].runs
    assert runs.get(f"batch 1, length {length}, length values",
                    "plan: its code decides as at the shapes it was traced at").startswith("plan")


@pytest.mark.parametrize("length", [POSITIONS, 200])
def test_lengths_where_it_decides_otherwise_are_refused(lact, length):
    converted, _ = lact
    with pytest.raises(ttt2la.UnsupportedShapeError, match="max_position_embeddings"):
        with torch.no_grad():
            converted(torch.randn(1, length, D))


def _value(*outcomes) -> LengthValue:
    return LengthValue("f.py", 3, "if T > 100:", "branches on", outcomes=outcomes)


def _held(*found) -> LengthVouching:
    held = LengthVouching("…", found=found, traced=((2, 32), (2, 40), (3, 32)), unit=2)
    for B, L in held.traced:
        held.lengths[held.key(B, L)] = True
    return held


def test_decided_alike_reads_each_decision_at_the_traced_shapes_and_the_new_one():
    over = (False, lambda L, B: L > 100)
    held = _held(_value(over))
    assert held.decided_alike(2, 64) and held.holds(2, 64)          # remembered
    assert not held.decided_alike(2, 128) and not held.holds(2, 128)
    batch = (False, lambda L, B: B % 4 == 0)            # 4, 4, 6 tokens' batches: it varies
    assert not _held(_value(batch)).decided_alike(2, 64)


@pytest.mark.parametrize("outcomes", [
    (),                                                  # read off the source only
    ((True, lambda L, B: L // 2),),                      # a number passed to torch
    ((False, lambda L, B: 1 // (L - 64)),),              # fails at the new length
], ids=["source only", "number", "fails"])
def test_uses_it_cannot_read_vouch_for_nothing(outcomes):
    assert not _held(_value(*outcomes)).decided_alike(2, 64)
