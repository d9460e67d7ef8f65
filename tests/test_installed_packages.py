"""Code of installed packages is no user's code, wherever pip put it: a package installed with
``--target`` into a directory on ``sys.path`` (its ``*.dist-info`` records beside it) is a
library like one in ``site-packages``. What matters is what the conversion reads as the user's:
a library that decides on the call's sizes in Python (einops caches its reshapes by shape) would
otherwise pin a lossy conversion to the example's shapes, naming the library's line.
"""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from ttt2la.errors import UnsupportedShapeError
from ttt2la.frontend import user_code

#: a helper that caches its reshape by the input's shape, as einops's ``rearrange`` does
SHAPELIB = textwrap.dedent('''
    _CACHE = {}

    def heads(t, h):
        key = tuple(t.shape)
        if key not in _CACHE:
            B, L, F = key
            _CACHE[key] = (B, L, h, F // h)
        return t.reshape(_CACHE[key]).transpose(1, 2)
''')


class RateMemory(nn.Module):
    """Linear attention over chunks with a per-token rate (lossy at level 4), its heads split
    by the installed helper."""

    def __init__(self, heads_of, d: int = 16, H: int = 2, C: int = 8):
        super().__init__()
        self.heads_of, self.H, self.C = heads_of, H, C
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.lr_fc = nn.Linear(d, H)
        self.w = nn.Parameter(torch.randn(H, d // H, d // H) / 3)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (self.heads_of(t, self.H) for t in self.qkv(x).chunk(3, -1))
        lr = F.softplus(self.lr_fc(x)).transpose(1, 2).unsqueeze(-1)
        W = self.w.expand(B, -1, -1, -1)
        outs = []
        for s in range(0, L, self.C):
            outs.append(q[:, :, s:s + self.C] @ W)
            W = W + k[:, :, s:s + self.C].transpose(-1, -2) @ (v[:, :, s:s + self.C]
                                                               * lr[:, :, s:s + self.C])
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, -1)


@pytest.fixture
def shapelib(tmp_path, monkeypatch):
    """``shapelib`` imported from a fresh directory on ``sys.path``; ``installed(True)`` gives
    that directory the records pip leaves."""
    site = tmp_path / "site"
    (site / "shapelib").mkdir(parents=True)
    (site / "shapelib" / "__init__.py").write_text(SHAPELIB)
    monkeypatch.syspath_prepend(str(site))

    def load(installed: bool):
        if installed:
            (site / "shapelib-1.0.dist-info").mkdir()
        for cache in (user_code.library_roots, user_code.is_users):
            cache.cache_clear()
        sys.modules.pop("shapelib", None)
        return importlib.import_module("shapelib")

    yield load
    sys.modules.pop("shapelib", None)
    monkeypatch.undo()
    for cache in (user_code.library_roots, user_code.is_users):
        cache.cache_clear()


@pytest.mark.parametrize("installed", [True, False])
def test_an_installed_helper_deciding_on_the_shape_leaves_the_lossy_layer_any_shape(
        shapelib, installed):
    heads = shapelib(installed).heads
    torch.manual_seed(0)
    fast = ttt2la.convert(RateMemory(heads), level=4, example_inputs=(torch.randn(2, 32, 16),))
    for shape in [(3, 32, 16), (2, 24, 16)]:
        x = torch.randn(shape)
        if installed:
            assert fast(x).shape == shape
        else:                   # the same code as the user's own: its decision pins the shapes
            with pytest.raises(UnsupportedShapeError, match="shapelib"):
                fast(x)
