"""The op vocabulary: every name is a real aten op, the categories the analysis dispatches on are
disjoint, and dependence, roles, rules and the lowering classify one op of each category as
the vocabulary says."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ttt2la.analysis import Dep, analyze_dependence, op_vocabulary as ops
from ttt2la.analysis.roles import final_products, matmul_operands, peel_views
from ttt2la.analysis.rules import constant_value, match_norm
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering.executors import shape_only
from ttt2la.lowering.whole_sequence import drop_identity_views

aten = torch.ops.aten
B, D, L, C = 2, 3, 8, 4


def _name_categories() -> dict[str, frozenset]:
    """Every public category of op names: the frozensets and the keys of the mappings."""
    found = {}
    for name in ops.__all__:
        value = getattr(ops, name)
        if name.endswith("_TARGETS") or not isinstance(value, (frozenset, Mapping)):
            continue
        found[name] = frozenset(value)
    return found


CATEGORIES = _name_categories()

# The categories the dependence analysis dispatches on, in turn: an op in two would be
# classified by whichever it tests first.
DISPATCHED = ("SHAPE_ONLY", "RESHAPES", "COPIES", "PERMUTES", "EXPANDS", "SLICES", "ADDITIVE",
              "MATMULS", "LINEAR_MAPS", "LINEAR_JOINS", "LINEAR_GATHERS", "KNOWN_NONLINEAR")


def test_the_vocabulary_has_the_categories_the_analysis_uses():
    assert set(DISPATCHED) <= set(CATEGORIES)
    assert all(CATEGORIES[c] for c in CATEGORIES), "an empty category"


@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_every_name_is_an_aten_overload_packet(category):
    missing = sorted(n for n in CATEGORIES[category]
                     if not isinstance(getattr(aten, n, None), torch._ops.OpOverloadPacket))
    assert not missing, f"{category}: not aten ops: {missing}"


@pytest.mark.parametrize("targets, category", [
    ("RESHAPE_TARGETS", "VIEWS"), ("RELAYOUT_TARGETS", "VIEWS"), ("SLICE_TARGETS", "SLICES"),
    ("SELECT_TARGETS", "LINEAR_MAPS")])
def test_targets_are_overloads_of_their_category(targets, category):
    for target in getattr(ops, targets):
        assert isinstance(target, torch._ops.OpOverload)
        assert target.overloadpacket.__name__ in CATEGORIES[category]
    assert aten.view.dtype not in ops.RELAYOUT_TARGETS          # a bit cast, not a view
    assert ops.RESHAPE_TARGETS <= ops.RELAYOUT_TARGETS


def test_dispatched_categories_are_disjoint():
    for i, a in enumerate(DISPATCHED):
        for b in DISPATCHED[i + 1:]:
            both = CATEGORIES[a] & CATEGORIES[b]
            assert not both, f"{a} and {b} share {sorted(both)}"


def test_fill_categories_are_disjoint_and_shape_only():
    fills = ("CONSTANT_FILLS", "FILL_VALUE_ARGUMENTS", "EMPTY_FILLS", "RANDOM_FILLS",
             "SIZE_VALUES")
    for i, a in enumerate(fills):
        for b in fills[i + 1:]:
            assert not CATEGORIES[a] & CATEGORIES[b], (a, b)
    assert ops.SHAPE_ONLY == frozenset().union(*(CATEGORIES[f] for f in fills))
    assert ops.TENSOR_SHAPED_FILLS <= ops.SHAPE_ONLY


def test_subcategories_sit_inside_their_category():
    assert ops.VIEWS == ops.RESHAPES | ops.COPIES | ops.PERMUTES | ops.EXPANDS
    assert ops.CASTS <= ops.COPIES and ops.VALUE_PRESERVING == ops.VIEWS - ops.CASTS
    assert ops.MATRIX_PRODUCTS <= set(ops.MATMULS)
    assert ops.UNARY_FUNCTIONS | ops.NORM_REDUCTIONS | ops.NORM_LAYERS <= ops.KNOWN_NONLINEAR
    assert ops.NORM_LAYERS | ops.NORM_REDUCTIONS <= ops.NORMALISATION_OPS
    assert set(ops.INDEX_ARGUMENTS) <= ops.LINEAR_MAPS | ops.LINEAR_JOINS | ops.LINEAR_GATHERS
    assert ops.UPDATE_STEPS <= ops.ADDITIVE
    assert ops.TRANSPOSES <= ops.PERMUTES
    assert ops.ACTIVATIONS | ops.ELEMENTWISE_FUNCTIONS <= ops.KNOWN_NONLINEAR
    assert not ops.ELEMENTWISE_FUNCTIONS & ops.SOFTMAXES
    assert ops.SOFTMAXES <= ops.UNARY_FUNCTIONS
    # an output path walks through linear ops only
    assert not ops.OUTPUT_PATH_LINEAR & (ops.KNOWN_NONLINEAR | set(ops.MATMULS) | ops.SHAPE_ONLY)


def _schema_types(name: str) -> list[list[str]]:
    packet = getattr(aten, name)
    return [[str(a.type) for a in getattr(packet, o)._schema.arguments] for o in packet.overloads()]


@pytest.mark.parametrize("name", sorted(ops.MATMULS))
def test_matmul_positions_are_tensor_arguments(name):
    operands, additive = ops.MATMULS[name]
    assert len(operands) == 2
    assert any(len(t) > max(operands + additive)
               and all("Tensor" in t[i] for i in operands + additive)
               for t in _schema_types(name)), name


@pytest.mark.parametrize("name", sorted(ops.INDEX_ARGUMENTS))
def test_index_positions_are_tensor_arguments(name):
    positions = ops.INDEX_ARGUMENTS[name]
    assert any(len(t) > max(positions) and t[0] == "Tensor"
               and all("Tensor" in t[i] for i in positions) for t in _schema_types(name)), name


@pytest.mark.parametrize("name", sorted(ops.FILL_VALUE_ARGUMENTS))
def test_fill_value_positions_are_numbers(name):
    position = ops.FILL_VALUE_ARGUMENTS[name]
    assert any(len(t) > position and t[position] == "number" for t in _schema_types(name)), name


def _fill_args(name: str, x: torch.Tensor) -> tuple:
    if name.endswith("_like"):
        return (x,)
    if name.startswith("new_"):
        return (x, [2, 3])
    return ([2, 3],)


@pytest.mark.parametrize("name", sorted(ops.CONSTANT_FILLS))
def test_constant_fills_write_their_value(name):
    out = getattr(aten, name)(*_fill_args(name, torch.full((2, 3), 7.0)))
    assert torch.equal(out, torch.full((2, 3), ops.CONSTANT_FILLS[name]))


# -- the analyses classify each category as the vocabulary says -------------------------------

def _program(op):
    """A one-state loop whose body computes ``op(W, k)`` from the state ``W`` (kept alive by a
    zero-weighted term of the update)."""
    def body(W, k, v, q):
        y = op(W, k)
        return (W + k.transpose(-1, -2) @ v + 0.0 * y.sum(),), (q @ W,)
    seq = lambda: torch.randn(B, L, D)  # noqa: E731
    return program_from_body(body, states=dict(W=torch.randn(B, D, D)),
                             streams=dict(k=seq(), v=seq(), q=seq()), chunk_size=C)


def _classified(op, category: frozenset):
    """The dependence on ``W`` of the value ``op`` computes, which must be an op of
    ``category``."""
    program = _program(op)
    zeroed = next(n for n in program.body.graph.nodes
                  if ops.calls(n, {"mul"}) and 0.0 in n.args)          # 0.0 * y.sum()
    y = zeroed.args[0].args[0]
    while not ops.calls(y, category) and ops.is_view(y):     # a matmul's reshape of its result
        y = y.args[0]
    assert ops.calls(y, category), f"{y.target} is not in the category"
    return analyze_dependence(program).of(y, 0)


def _index_of_max(W, k):
    return W.index_select(1, W[0].sum(0).argmax(0, keepdim=True))


CASES = [
    # (category, op on the state W (and the chunk k), class, layout tracked, mixes tokens)
    ("RESHAPES", lambda W, k: W.reshape(B, D * D).reshape(B, D, D), Dep.IDENTITY, True, False),
    ("COPIES", lambda W, k: W.clone(), Dep.IDENTITY, True, False),
    ("PERMUTES", lambda W, k: W.transpose(1, 2), Dep.MATRIX_AFFINE, True, False),
    ("EXPANDS", lambda W, k: W.unsqueeze(1).expand(B, 2, D, D), Dep.MATRIX_AFFINE, False, False),
    ("SLICES", lambda W, k: W[:, :2], Dep.MATRIX_AFFINE, False, False),
    ("ADDITIVE", lambda W, k: -W, Dep.SCALAR_AFFINE, True, False),
    ("LINEAR_MAPS", lambda W, k: W.sum(1), Dep.MATRIX_AFFINE, False, False),
    ("LINEAR_JOINS", lambda W, k: torch.cat([W, k], 1), Dep.MATRIX_AFFINE, False, True),
    ("LINEAR_GATHERS", lambda W, k: W.index_select(1, torch.tensor([0, 2])), Dep.MATRIX_AFFINE,
     False, False),
    ("LINEAR_GATHERS", _index_of_max, Dep.NONLINEAR, False, False),   # index read from W
    ("MATMULS", lambda W, k: k @ W, Dep.MATRIX_AFFINE, False, True),
    ("MATMULS", lambda W, k: W @ W, Dep.LOCAL, False, False),       # W·W: state-local
    ("KNOWN_NONLINEAR", lambda W, k: torch.tanh(W), Dep.LOCAL, False, False),
    ("KNOWN_NONLINEAR", lambda W, k: torch.tanh(k @ W), Dep.NONLINEAR, False, True),
    ("SHAPE_ONLY", lambda W, k: torch.ones_like(W), Dep.INDEPENDENT, False, False),
]


@pytest.mark.parametrize("category, op, cls, tracked, mixed", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_dependence_classifies_each_category(category, op, cls, tracked, mixed):
    d = _classified(op, CATEGORIES[category])
    assert d.cls == cls
    assert (d.layout is not None) == tracked
    assert d.token_mixed == mixed


def test_an_op_outside_the_vocabulary_is_nonlinear_even_on_the_state_alone():
    op = lambda W, k: torch.special.bessel_j0(W)  # noqa: E731
    assert not any("special_bessel_j0" in c for c in CATEGORIES.values())
    program = _program(op)
    node = next(n for n in program.body.graph.nodes
                if n.op == "call_function" and ops.op_name(n) == "special_bessel_j0")
    assert analyze_dependence(program).of(node, 0).cls == Dep.NONLINEAR


def _traced(fn, *shapes):
    return make_fx(fn)(*(torch.randn(*s) for s in shapes))


def _last(gm, category):
    return [n for n in gm.graph.nodes if ops.calls(n, category)][-1]


def _output(gm):
    """The (first) value a traced function returns."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return out[0] if isinstance(out, (tuple, list)) else out


def test_roles_peel_views_and_walk_linear_output_paths():
    gm = _traced(lambda W: W.transpose(0, 1).reshape(-1).clone(), (D, D))
    out = _output(gm)
    assert ops.is_view(out) and peel_views(out).op == "placeholder"

    def linear_path(W, k, v, q):
        return (W + k.transpose(-1, -2) @ v,), ((q @ W)[..., :2].sum(-1, keepdim=True),)

    def nonlinear_path(W, k, v, q):
        return (W + k.transpose(-1, -2) @ v,), (torch.tanh(q @ W),)
    seq = lambda: torch.randn(B, L, D)  # noqa: E731
    made = [program_from_body(body, states=dict(W=torch.randn(B, D, D)),
                              streams=dict(k=seq(), v=seq(), q=seq()), chunk_size=C)
            for body in (linear_path, nonlinear_path)]
    assert [f.state for f in final_products(made[0])] == [0]
    assert final_products(made[1]) == []        # tanh is not in OUTPUT_PATH_LINEAR


def test_matmul_operands_follow_the_vocabulary_positions():
    gm = _traced(lambda b, x, y: torch.addmm(b, x, y), (D, D), (D, D), (D, D))
    node = _last(gm, ops.MATMULS)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert ops.op_name(node) == "addmm" and ops.MATMULS["addmm"].operands == (1, 2)
    assert matmul_operands(node) == placeholders[1:]


def test_rules_read_norms_and_constants_through_the_vocabulary():
    gm = _traced(lambda x: x / (x.norm(dim=-1, keepdim=True) + 1e-6), (D, D))
    division = _last(gm, {"div"})
    assert match_norm(division).kind == "l2"
    gm = _traced(lambda x: torch.nn.functional.layer_norm(x, (D,)), (D, D))
    assert match_norm(_output(gm)).kind == "layer"

    gm = _traced(lambda x: (torch.full_like(x, 3.0).t() + torch.ones_like(x)).to(torch.float64),
                 (D, D))
    assert constant_value(_output(gm)) == 4.0
    assert constant_value(_last(gm, ops.FILL_VALUE_ARGUMENTS)) == 3.0
    gm = _traced(lambda x: torch.empty_like(x), (D, D))
    assert constant_value(_last(gm, ops.EMPTY_FILLS)) is None       # no value to read
    assert ops.fill_value(_last(gm, ops.EMPTY_FILLS)) is None


def test_indexing_traces_to_the_slice_and_select_targets():
    gm = _traced(lambda x: x[:, 1:3] + x[0, :2], (D, D))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert ops.SLICE_TARGETS <= targets and ops.SELECT_TARGETS <= targets


def test_lowering_keeps_exact_overloads():
    gm = _traced(lambda x: (torch.zeros_like(x), x.view(torch.int32), x.view(D, D)), (D, D))
    assert shape_only(_last(gm, ops.CONSTANT_FILLS))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.view.dtype in targets and aten.view.default in targets
    drop_identity_views(gm)
    left = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.view.dtype in left                  # a bit cast keeps its shape, but stays
    assert aten.view.default not in left            # a no-op reshape is dropped


def _unary(name: str):
    """``aten.name`` as a function of one tensor, with literal extra arguments where needed."""
    extra = {"clamp": (-0.5, 0.5), "clamp_min": (-0.5,), "clamp_max": (0.5,), "pow": (3,),
             "softmax": (-1,), "_softmax": (-1, False), "log_softmax": (-1,),
             "_log_softmax": (-1, False)}.get(name, ())
    return lambda x: getattr(aten, name)(x, *extra)


@pytest.mark.parametrize("name", sorted(ops.ELEMENTWISE_FUNCTIONS))
def test_elementwise_functions_act_on_each_element_alone(name):
    f = _unary(name)
    x = torch.rand(3, 4, dtype=torch.float64) + 0.25
    y = x.clone()
    y[1, 2] += 0.125
    fx, fy = f(x), f(y)
    assert fx.shape == x.shape
    changed = (fx != fy)
    changed[1, 2] = False
    assert not changed.any(), f"{name}: changing one element changed others"


@pytest.mark.parametrize("name", sorted(ops.SOFTMAXES))
def test_softmaxes_mix_their_axis(name):
    x = torch.rand(3, 4, dtype=torch.float64)
    y = x.clone()
    y[1, 2] += 0.125
    assert (_unary(name)(x)[1] != _unary(name)(y)[1]).sum() == 4


@pytest.mark.parametrize("name", sorted(ops.ACTIVATIONS))
def test_activations_are_nonlinear(name):
    f = _unary(name)
    x = torch.linspace(-2.0, 2.0, 8, dtype=torch.float64)
    y = x.flip(0) + 0.5
    assert not torch.allclose(f(x + y), f(x) + f(y)), name


@pytest.mark.parametrize("name", sorted(ops.SCALINGS))
def test_scalings_are_linear_in_their_first_operand(name):
    f = getattr(aten, name)
    x, y = torch.randn(2, 3, 4, dtype=torch.float64).unbind(0)
    c = torch.tensor([0.5, -2.0, 4.0, 1.5], dtype=torch.float64)
    apply = (lambda t: f(t)) if name == "neg" else (lambda t: f(t, c))
    torch.testing.assert_close(apply(3 * x - 2 * y), 3 * apply(x) - 2 * apply(y))


@pytest.mark.parametrize("name", sorted(ops.TRANSPOSES))
def test_transposes_swap_two_axes(name):
    x = torch.arange(12.0).reshape(3, 4)
    dims = () if name in ("t", "t_copy", "mT") else (0, 1)
    torch.testing.assert_close(getattr(aten, name)(x, *dims), x.T.contiguous())
