"""The check every test of a layer whose code computes Python values of the call's sizes makes:
a converted layer computes the code's function at a shape — the original's output and
gradients at an exact level, the simplified function at a lossy one — or refuses the shape."""
import inspect

import torch

import ttt2la
from ttt2la.errors import ConversionError
from ttt2la.testing import rel_rms_error

from equivalence import assert_same_function


def folded_factor(conv) -> float:
    """The momentum's accumulation factor a lossy conversion folded (1 where it is exact)."""
    for p in conv.ttt2la_report.layers[0].passes:
        if p.name == "remove_momentum" and p.folded:
            return next(iter(p.folded.values()))
    return 1.0


def same_or_refused(layer, conv, T: int, B: int = 2, D: int = 8) -> str:
    """One call at length ``T`` and batch size ``B`` of ``D`` features: ``"same"`` (the
    original's output and gradients, at an exact level), ``"simplified"`` (``layer.simplified``
    with the folded factor, at a lossy one) or ``"refused"`` (a ``ConversionError``)."""
    torch.manual_seed(T * 64 + B)
    x = torch.randn(B, T, D)
    if conv.ttt2la_report.exact:
        assert_same_function(conv, layer, x)
        return "same"
    with torch.no_grad():
        try:
            got = conv(x)
        except ConversionError:
            return "refused"
        want = layer.simplified(x, folded_factor(conv))
    assert rel_rms_error(got, want) <= 1e-5, f"length {T}, batch {B}: another branch's output"
    return "simplified"


def each_call_same_or_refused(make, level: int, example: int, calls: list[int],
                              D: int = 8) -> None:
    """The layer ``make()`` converted at ``level`` from an example of ``example`` tokens (a
    refused conversion is an answer too), then called at that length and at ``calls``: each call
    the code's function or refused (``same_or_refused``)."""
    torch.manual_seed(example)
    layer = make()
    try:
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, example, D),))
    except ConversionError:
        return
    for T in [example, *calls]:
        same_or_refused(layer, conv, T, D=D)


def loop_line(fn) -> int:
    """The line of the first ``for`` statement in ``fn``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if text.strip().startswith("for "))
