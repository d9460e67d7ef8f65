"""The comparison equivalence tests make: a converted layer and the layer as written give the same
output and the same gradient of ``<output, g>`` for the input and every parameter."""
import torch
from hypothesis import strategies as st

from ttt2la.testing import TOLERANCE, rel_rms_error

FP32 = TOLERANCE[torch.float32]


def outputs_and_grads(module, x, g):
    """The output and the gradients of ``<module(x), g>`` w.r.t. ``x`` and every parameter; a
    parameter the output does not read (a last update no token reads) has gradient zero."""
    xi = x.clone().requires_grad_(True)
    y = module(xi)
    names = ["x", *(n for n, _ in module.named_parameters())]
    params = [xi, *module.parameters()]
    grads = torch.autograd.grad((y * g).sum(), params, allow_unused=True)
    return y.detach(), {n: torch.zeros_like(p) if d is None else d
                        for n, p, d in zip(names, params, grads)}


def assert_same_function(converted, reference, xs, tol: float = FP32, seed: int = 5,
                         conditioned: bool = False):
    """Output and every gradient of ``converted`` within ``tol`` of ``reference``'s on each input
    of ``xs`` (a tensor or a list of them), for a fixed random cotangent.

    ``conditioned``: a quantity beyond ``tol`` passes only where the bound is out of reach of
    fp32 code, the reference included — its own error against a float64 evaluation exceeds
    ``tol`` (a scalar gradient that sums terms cancelling each other) — and then the precision
    criterion judges it: no further from float64 than twice the reference's error, plus 1e-6."""
    for x in [xs] if isinstance(xs, torch.Tensor) else xs:
        with torch.no_grad():
            shape = reference(x).shape
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)
        yc, gc = outputs_and_grads(converted, x, g)
        yr, gr = outputs_and_grads(reference, x, g)
        assert gc.keys() == gr.keys()
        got, want = {"output": yc, **gc}, {"output": yr, **gr}
        far = {n: rel_rms_error(got[n], want[n]) for n in want}
        far = {n: e for n, e in far.items() if e > tol}
        if far and conditioned:
            _assert_conditioned(got, want, far, reference, x, g, tol)
        else:
            for name, err in far.items():
                what = name if name == "output" else f"d/d{name}"
                raise AssertionError(f"{what} at {tuple(x.shape)}: {err:.3g}")


def _assert_conditioned(got, want, far, reference, x, g, tol):
    """Each quantity of ``far`` (beyond ``tol``) judged against a float64 evaluation (see
    ``assert_same_function``)."""
    import copy

    from ttt2la.testing import no_worse_than_original

    y64, g64 = outputs_and_grads(copy.deepcopy(reference).double(), x.double(), g.double())
    exact = {"output": y64, **g64}
    for name, err in far.items():
        own = rel_rms_error(want[name], exact[name])
        assert own > tol, f"{name} at {tuple(x.shape)}: {err:.3g} (the reference's own {own:.3g})"
        ok, mine, bound = no_worse_than_original([rel_rms_error(got[name], exact[name])], [own])
        assert ok, f"{name} at {tuple(x.shape)}: {err:.3g}; against float64 {mine:.3g} > {bound:.3g}"


def converted_onto(layer, op: str, example=(2, 12, 16), dtype=torch.float32):
    """``layer`` converted at level 0 on a random example of shape ``example``, its plan checked
    to run ``op`` (the report's runtime starts with it); the converted layer."""
    import ttt2la

    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(*example, dtype=dtype),))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith(op), report.runtime
    return conv


def assert_streams(conv, layer, x, cuts=(1, 2, 9, 20)):
    """Fed in pieces cut at ``cuts``, ``conv`` gives ``layer``'s outputs on the whole of ``x``
    (fp32 bound) and carries the state over every token."""
    with torch.no_grad():
        got, state = in_pieces(conv, x, cuts)
        ref = layer(x)
    assert rel_rms_error(got, ref) <= FP32
    assert state.tokens == x.shape[1]


def in_pieces(conv, x, cuts):
    """The converted layer run piece by piece (cut at ``cuts``), outputs joined, final state."""
    bounds = [0, *sorted(set(cuts)), x.shape[1]]
    state, outs = None, []
    for a, b in zip(bounds, bounds[1:]):
        y, state = conv(x[:, a:b], ttt_state=state, return_ttt_state=True)
        assert y.shape[1] == b - a
        outs.append(y)
    return torch.cat(outs, dim=1), state


@st.composite
def splits(draw, max_len: int, max_cuts: int = 6):
    """``(batch, length, cuts)``: a sequence and the points where streaming cuts it."""
    L = draw(st.integers(1, max_len))
    cuts = draw(st.lists(st.integers(1, max(1, L - 1)), max_size=max_cuts)) if L > 1 else []
    return draw(st.integers(1, 3)), L, sorted(set(cuts))
