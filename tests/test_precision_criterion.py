"""The precision criterion's judgment (``ttt2la.testing.assert_no_worse_than_original``, and
``assert_within_precision_criterion`` on modules): a quantity over the bound on the first inputs
is judged again on more of them, so a few unlucky inputs do not fail a conversion, while an error
on most inputs still does."""
import pytest
import torch

from ttt2la.testing import (CRITERION_CONFIRM_SAMPLES, CRITERION_SAMPLES,
                            assert_no_worse_than_original, assert_within_precision_criterion)


class _OffOnSomeCalls(torch.nn.Module):
    """A small fp32 network whose output is off by 1e-4 (relative) on the calls numbered in
    ``off``."""

    def __init__(self, off: set[int]):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.off, self.calls = off, 0

    def forward(self, x):
        out = self.fc2(torch.tanh(self.fc1(x)))
        self.calls += 1
        return out * (1 + 1e-4) if self.calls - 1 in self.off else out


def test_the_same_code_meets_the_criterion_on_the_first_inputs():
    conv = _OffOnSomeCalls(set())
    assert_within_precision_criterion(conv, _OffOnSomeCalls(set()), torch.randn(2, 5, 8))
    assert conv.calls == CRITERION_SAMPLES


@pytest.mark.parametrize("unlucky", [3, CRITERION_CONFIRM_SAMPLES // 2])
def test_a_few_inputs_off_are_judged_again_on_more(unlucky):
    """Most of the first inputs off fail the first judgment; fewer than half of all the inputs
    off pass the second, which sees every input."""
    conv = _OffOnSomeCalls(set(range(unlucky)))
    assert_within_precision_criterion(conv, _OffOnSomeCalls(set()), torch.randn(2, 5, 8))
    assert conv.calls == CRITERION_CONFIRM_SAMPLES


def test_most_inputs_off_fail_on_every_input():
    conv = _OffOnSomeCalls(set(range(CRITERION_CONFIRM_SAMPLES // 2 + 1)))
    with pytest.raises(AssertionError, match=f"over {CRITERION_CONFIRM_SAMPLES} inputs"):
        assert_within_precision_criterion(conv, _OffOnSomeCalls(set()), torch.randn(2, 5, 8))


@pytest.mark.parametrize("first, off", [(9, ()), (9, (0, 1, 2, 3, 4)), (5, (0, 1, 2))])
def test_errors_by_input_are_judged_first_on_the_inputs_asked_for(first, off):
    """``samples`` inputs first (here one quantity of the first inputs 3x the original's); where
    over the bound, judged again on ``CRITERION_CONFIRM_SAMPLES``, each input asked for once."""
    asked = []

    def errors_on(i):
        asked.append(i)
        return {"fine": (1e-6, 1e-6), "quantity": (3e-5 if i in off else 1e-5, 1e-5)}

    assert_no_worse_than_original(errors_on, samples=first)
    confirmed = 2 * len(off) > first
    assert asked == list(range(CRITERION_CONFIRM_SAMPLES if confirmed else first))
