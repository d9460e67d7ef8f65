"""A lossy conversion's folds were measured on the weights it was converted with: loading other
weights into it keeps those constants, so ``load_state_dict`` warns
(``FoldsFromOtherWeightsWarning``, naming the layer, the passes that folded and the line that
loaded) — and stays quiet where nothing is lost: the same weights again, an exact conversion,
folds replayed knowingly (``folds=report.folds()``) and a converted checkpoint read back.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from ttt2la import FoldsFromOtherWeightsWarning
from ttt2la.testing import rel_rms_error


class RateMemory(nn.Module):
    """Linear attention over chunks of 4 with a per-token rate: level 4 folds its mean."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.rate = nn.Linear(d, 1)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        lr = F.softplus(self.rate(x))
        W, outs = x.new_zeros(B, d, d), []
        for s in range(0, L, 4):
            outs.append(q[:, s:s + 4] @ W)
            W = W + k[:, s:s + 4].transpose(1, 2) @ (v[:, s:s + 4] * lr[:, s:s + 4])
        return torch.cat(outs, 1)


def _pair():
    torch.manual_seed(0)
    old, new = RateMemory(), RateMemory()
    with torch.no_grad():
        new.rate.bias.fill_(2.0)            # another mean rate: another fold
    return old, new


X = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1))


def _loading(fast, weights) -> list:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast.load_state_dict(weights)
    return [w for w in seen if issubclass(w.category, FoldsFromOtherWeightsWarning)]


def test_loading_other_weights_into_a_lossy_conversion_warns_naming_what_stays():
    old, new = _pair()
    fast = ttt2la.convert(old, level=4, example_inputs=(X,))
    seen = _loading(fast, new.state_dict())
    assert len(seen) == 1
    message = str(seen[0].message)
    assert "absorb_lr" in message and "folds=report.folds()" in message
    assert seen[0].filename == __file__                     # the line that loaded
    refolded = ttt2la.convert(new, level=4, example_inputs=(X,))
    with torch.no_grad():                   # what it warns of: the old constants stayed
        assert rel_rms_error(fast(X), refolded(X)) > 1e-3


def test_nothing_is_lost_so_nothing_is_said():
    old, new = _pair()
    fast = ttt2la.convert(old, level=4, example_inputs=(X,))
    assert _loading(fast, old.state_dict()) == []           # the same weights again
    exact = ttt2la.convert(old, level=2, example_inputs=(X,))
    assert _loading(exact, new.state_dict()) == []          # nothing folded
    kept = ttt2la.convert(old, level=4, example_inputs=(X,),
                          folds=fast.ttt2la_report.folds())
    assert _loading(kept, new.state_dict()) == []           # folds replayed knowingly


def test_a_converted_checkpoint_reads_back_quietly(tmp_path):
    old, _ = _pair()
    fast = ttt2la.convert(old, level=4, example_inputs=(X,))
    ttt2la.save(fast, tmp_path / "ckpt", factory=f"{__name__}:RateMemory",
                example_inputs=(X,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FoldsFromOtherWeightsWarning)
        back = ttt2la.load(tmp_path / "ckpt", trust_factory=True)
    with torch.no_grad():
        assert rel_rms_error(back(X), fast(X)) <= 1e-6


def test_report_folds_replays_the_conversion():
    old, _ = _pair()
    fast = ttt2la.convert(old, level=4, example_inputs=(X,))
    folds = fast.ttt2la_report.folds()
    assert list(folds) == [fast.ttt2la_report.layers[0].module_path]
    assert set(folds[fast.ttt2la_report.layers[0].module_path]) == {"absorb_lr"}
    again = ttt2la.convert(old, level=4, example_inputs=(X[:, :8],), folds=folds)
    with torch.no_grad():
        assert rel_rms_error(again(X), fast(X)) <= 1e-6


def test_weights_loaded_on_the_meta_device_or_after_to_empty_are_fingerprinted():
    """Meta tensors hold no values: their load is compared by name and shape (no error); the
    weights put back after ``to_empty`` are the conversion's own, and nothing is said."""
    old, _ = _pair()
    fast = ttt2la.convert(old, level=4, example_inputs=(X,))
    weights = {k: v.clone() for k, v in fast.state_dict().items()}
    fast.to("meta")
    assert _loading(fast, {k: v.to("meta") for k, v in weights.items()}) == []
    fast.to_empty(device="cpu")
    assert _loading(fast, weights) == []
