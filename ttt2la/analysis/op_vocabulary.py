"""The op vocabulary: which aten ops the analysis and lowering know, and in which category.

A traced loop body is a graph of aten ops. The dependence analysis, the role finder, the rule
matchers, the checker and the lowering all reason about the same families of ops — relayouts,
copies, slices, linear maps, fills, matmuls, norms, nonlinear functions. They are stated here
once, by aten overload-packet name (``aten.add.Tensor`` → ``"add"``, see ``op_name``), so that
a new op is taught to every module at one place. Where a lowering must match the exact traced
overload (``view.default`` but not ``view.dtype``, which reinterprets bits), the ``*_TARGETS``
sets hold overloads.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping, NamedTuple

import torch
import torch.fx

aten = torch.ops.aten


def op_name(node: torch.fx.Node) -> str:
    """The aten overload-packet name of a node: ``add`` for ``aten.add.Tensor``."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def calls(node, names: Iterable[str]) -> bool:
    """Whether ``node`` is an fx call of one of the ops ``names`` (packet names)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and op_name(node) in names


# -- moving and copying data ----------------------------------------------------------------

#: Reshapes: the value is its first argument with another shape, elements in the same order.
RESHAPES = frozenset({
    "view", "_unsafe_view", "reshape", "view_copy", "_reshape_alias", "flatten", "unflatten",
    "unsqueeze", "squeeze", "unsqueeze_copy", "squeeze_copy", "view_as"})

#: Casts: a copy of the first argument, possibly in another dtype or on another device.
CASTS = frozenset({"_to_copy", "to", "type_as"})

#: Copies: the value equals its first argument (a cast may change its dtype).
COPIES = CASTS | frozenset({
    "clone", "detach", "alias", "contiguous", "lift_fresh_copy", "lift_fresh", "detach_copy",
    "alias_copy"})

#: Transposes: the first argument with two dimensions swapped — ``transpose(x, d0, d1)`` and
#: ``swapaxes``; ``t``, ``t_copy`` and ``mT`` take no dimensions and swap the last two.
TRANSPOSES = frozenset({"transpose", "transpose_copy", "swapaxes", "t", "t_copy", "mT"})

#: Permutes: the first argument with its dimensions reordered.
PERMUTES = TRANSPOSES | frozenset({"permute", "permute_copy", "movedim"})

#: Expands: the first argument broadcast to a larger shape, without copying.
EXPANDS = frozenset({"expand", "expand_copy", "expand_as", "broadcast_to"})

#: Views: ops whose value is their first argument relaid out or copied, no element changed or
#: dropped — a matmul operand "is" the state through any chain of them (``peel_views``).
VIEWS = RESHAPES | COPIES | PERMUTES | EXPANDS

#: Views that keep the dtype: every element of the result equals an element of the input, so a
#: constant stays the same constant through them.
VALUE_PRESERVING = VIEWS - CASTS

#: Slices: a contiguous range of the first argument along one dimension.
SLICES = frozenset({"slice", "slice_copy", "narrow", "narrow_copy"})


# -- linear ops -----------------------------------------------------------------------------

#: Additive ops: ``x + αy``, ``x - αy``, ``αy - x`` (``rsub``) and ``-x``.
ADDITIVE = frozenset({"add", "sub", "rsub", "neg"})

#: Scalings: elementwise products and quotients, and negation — linear in a data operand
#: while the other factor does not depend on it.
SCALINGS = frozenset({"mul", "div", "neg"})

#: How a fast weight is stepped in a single-step layer: ``W + Δ`` or ``W - Δ``.
UPDATE_STEPS = frozenset({"add", "sub"})

#: Pointwise arithmetic whose number arguments are values, never positions or sizes.
ARITHMETIC = ADDITIVE | SCALINGS | frozenset({"true_divide", "pow", "addcmul", "addcdiv"})

#: Reductions that divide by the number of elements they reduce.
AVERAGES = frozenset({"mean", "var", "std", "var_mean", "std_mean"})

#: Linear maps of their data operand(s) that do not keep its layout: selections, strided and
#: index views, triangles and diagonals, padding, masking, reductions by sum, splits, and
#: ``copy``/``copy_`` (whose value is the source, their *second* argument, broadcast).
LINEAR_MAPS = frozenset({
    "select", "select_copy", "as_strided", "repeat", "flip", "roll", "diagonal", "unfold",
    "tril", "triu", "diag", "diag_embed", "trace", "pixel_shuffle", "im2col", "col2im",
    "constant_pad_nd", "pad", "_unsafe_index", "masked_fill", "sum", "mean", "cumsum", "nansum",
    "sum_to_size", "split", "split_with_sizes", "chunk", "unbind", "unsafe_split",
    "tensor_split", "repeat_interleave", "copy", "copy_"})

#: Running ops along an axis: each element reads the ones before it (prefix sums and products,
#: their log-space and extremum forms, and a roll's shift).
RUNNING_OPS = frozenset({
    "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "_cummax_helper", "_cummin_helper",
    "roll"})

#: Linear joins: several data operands assembled into one value (concatenation, scatters).
LINEAR_JOINS = frozenset({
    "cat", "stack", "slice_scatter", "select_scatter", "diagonal_scatter",
    "as_strided_scatter", "index_put", "scatter", "scatter_add", "index_add"})

#: Gathers: linear in their data operand, addressed by an index tensor.
LINEAR_GATHERS = frozenset({"index_select", "gather", "index"})

#: Index operands: the argument positions that address rather than carry data. A value is
#: linear in the data only while these do not depend on it.
INDEX_ARGUMENTS: Mapping[str, tuple[int, ...]] = MappingProxyType({
    "index_select": (2,), "gather": (2,), "index": (1,), "scatter": (2,), "scatter_add": (2,),
    "index_put": (1,), "index_add": (2,), "masked_fill": (1,), "_unsafe_index": (1,)})

#: Linear ops an output path may pass through between the final product ``φ·W`` and a chunk
#: output: views, slices and selections, sums, elementwise scaling and a few assemblies.
OUTPUT_PATH_LINEAR = VIEWS | SLICES | frozenset({
    "add", "sub", "rsub", "neg", "mul", "where", "cat", "stack", "select", "slice_scatter",
    "select_scatter", "sum", "mean", "copy", "masked_fill", "constant_pad_nd", "pad"})


class Bilinear(NamedTuple):
    """Where a bilinear op reads its factors (``operands``) and any added term (``additive``)."""

    operands: tuple[int, ...]
    additive: tuple[int, ...]


_PRODUCT = Bilinear((0, 1), ())
_WITH_BIAS = Bilinear((0, 1), (2,))
_ADD_PRODUCT = Bilinear((1, 2), (0,))

#: Matmuls and convolutions: bilinear in two operands, plus an optional added term.
MATMULS: Mapping[str, Bilinear] = MappingProxyType({
    "mm": _PRODUCT, "bmm": _PRODUCT, "matmul": _PRODUCT, "mv": _PRODUCT, "dot": _PRODUCT,
    "vdot": _PRODUCT, "outer": _PRODUCT, "inner": _PRODUCT, "tensordot": _PRODUCT,
    "linear": _WITH_BIAS, "baddbmm": _ADD_PRODUCT, "addmm": _ADD_PRODUCT,
    "addbmm": _ADD_PRODUCT, "addmv": _ADD_PRODUCT, "addr": _ADD_PRODUCT,
    "convolution": _WITH_BIAS, "_convolution": _WITH_BIAS, "conv1d": _WITH_BIAS,
    "conv2d": _WITH_BIAS, "conv3d": _WITH_BIAS})

#: The plain matrix products ``a @ b``: two operands, nothing added, no transposed factor.
MATRIX_PRODUCTS = frozenset({"mm", "bmm", "matmul"})


# -- values that depend on shapes only ------------------------------------------------------

#: Fills with a fixed value: every element is this number, whatever the data.
CONSTANT_FILLS: Mapping[str, float] = MappingProxyType({
    "ones": 1.0, "ones_like": 1.0, "new_ones": 1.0,
    "zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0})

#: Fills whose value is an argument: the position of that argument.
FILL_VALUE_ARGUMENTS: Mapping[str, int] = MappingProxyType({
    "full": 1, "full_like": 1, "new_full": 2, "scalar_tensor": 0})

#: Uninitialised allocations: the value is unspecified; only the shape is meant.
EMPTY_FILLS = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})

#: Random fills: independent of every input's value.
RANDOM_FILLS = frozenset({"rand", "randn", "rand_like", "randn_like"})

#: Fills shaped like a tensor operand: they read its shape only (a static one once traced).
TENSOR_SHAPED_FILLS = frozenset({
    "ones_like", "new_ones", "zeros_like", "new_zeros", "empty_like", "new_empty", "full_like",
    "new_full"})

#: Size reads and index constructors, and ``.item()`` (``_local_scalar_dense``), which a traced
#: body only meets on sizes.
SIZE_VALUES = frozenset({
    "sym_size", "size", "sym_numel", "sym_stride", "arange", "eye", "_local_scalar_dense"})

#: Shape-only ops: their value does not depend on any operand's data.
SHAPE_ONLY = frozenset(CONSTANT_FILLS) | frozenset(FILL_VALUE_ARGUMENTS) | EMPTY_FILLS \
    | RANDOM_FILLS | SIZE_VALUES


def fill_value(node) -> float | None:
    """The number a fill op writes (``ones_like`` 1.0, ``full(s, v)`` v), or ``None`` when
    ``node`` is no fill of a known number."""
    if not calls(node, SHAPE_ONLY):
        return None
    name = op_name(node)
    if name in CONSTANT_FILLS:
        return CONSTANT_FILLS[name]
    position = FILL_VALUE_ARGUMENTS.get(name)
    value = node.args[position] if position is not None and len(node.args) > position else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# -- norms and nonlinear functions ----------------------------------------------------------

#: Norm reductions: the norm or the statistics of their first argument.
NORM_REDUCTIONS = frozenset({
    "linalg_vector_norm", "norm", "frobenius_norm", "linalg_norm", "var", "std", "var_mean",
    "std_mean"})

#: Normalisation layers as library ops.
NORM_LAYERS = frozenset({"native_layer_norm", "layer_norm", "rms_norm", "native_group_norm"})

#: Ops of a normalisation: a library layer, a norm reduction, or the root a hand-written norm
#: divides by.
NORMALISATION_OPS = NORM_LAYERS | NORM_REDUCTIONS | frozenset({"rsqrt", "sqrt"})

#: What may lie between a norm reduction and the value it divides by: an epsilon, clamps,
#: roots and reciprocals, scaling, broadcasts and copies.
NORM_SCALE_CHAIN = frozenset({
    "add", "sub", "clamp", "clamp_min", "clamp_max", "maximum", "max", "sqrt", "pow", "mul",
    "div", "reciprocal", "rsqrt", "expand", "expand_as", "view", "_unsafe_view", "reshape",
    "unsqueeze", "squeeze", "view_as", "_to_copy", "clone", "detach", "alias", "contiguous"})

#: Reductions that make a squared norm from squares: ``sum(x²)``, ``mean(x²)``.
SQUARE_REDUCTIONS = frozenset({"sum", "mean"})

#: Unary functions: nonlinear maps of one tensor (activations, exp and log, roots, softmax),
#: rendered in update rules as ``f(x)``.
UNARY_FUNCTIONS = frozenset({
    "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "relu", "gelu", "elu", "softplus",
    "abs", "sign", "reciprocal", "sin", "cos", "erf", "softmax", "_softmax", "log_softmax",
    "_log_softmax"})

#: Activations: the nonlinearities a hidden layer applies to its pre-activation (``exp`` and
#: softmax among them, as positive feature maps).
ACTIVATIONS = frozenset({
    "silu", "sigmoid", "tanh", "relu", "gelu", "elu", "softplus", "mish", "leaky_relu",
    "hardtanh", "hardswish", "exp", "softmax", "_softmax"})

#: Softmaxes: normalise along one axis, so each element of the value depends on the whole axis.
SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})

#: Elementwise functions: nonlinear maps applied to each element on its own (the unary
#: functions and activations less the softmaxes, clamps, powers), so the value keeps the
#: input's shape and an element depends on the same element only.
ELEMENTWISE_FUNCTIONS = (UNARY_FUNCTIONS | ACTIVATIONS | frozenset({
    "clamp", "clamp_min", "clamp_max", "pow", "square", "expm1", "log1p", "log2", "sgn"})) \
    - SOFTMAXES

#: Known nonlinear ops: state-local when they act on state-local values (weight norms,
#: Newton–Schulz, activations of a state). Ops in no category at all are taken as nonlinear
#: outright, so a value they compute from a state is never state-local.
KNOWN_NONLINEAR = UNARY_FUNCTIONS | ACTIVATIONS | ELEMENTWISE_FUNCTIONS | NORM_REDUCTIONS \
    | NORM_LAYERS | frozenset({
    "silu_backward", "sigmoid_backward", "tanh_backward", "expm1", "log1p", "log2", "pow",
    "gelu_backward", "elu_backward", "leaky_relu", "softplus_backward", "threshold_backward",
    "hardtanh", "mish", "sgn", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "max",
    "min", "amax", "amin", "_softmax_backward_data", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "floor", "ceil", "round", "trunc", "square",
    "prod", "logsumexp", "cumprod", "renorm", "einsum", "lerp"})


# -- exact traced overloads for the lowering ------------------------------------------------

#: Reshapes and broadcasts as traced overloads (``view.dtype``, a bit reinterpretation, is not
#: one): they change a value's shape only.
RESHAPE_TARGETS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default})

#: Reshapes, broadcasts and plain copies as traced overloads: the same values, relaid out.
RELAYOUT_TARGETS = RESHAPE_TARGETS | frozenset({
    aten.clone.default, aten.alias.default, aten.contiguous.default})


#: Slicing as traced from ``x[:, s:e]`` and selection as traced from ``x[i]``.
SLICE_TARGETS = frozenset({aten.slice.Tensor})
SELECT_TARGETS = frozenset({aten.select.int})


def is_view(node) -> bool:
    """Whether ``node`` is a view or copy of its first argument (see ``VIEWS``)."""
    return calls(node, VIEWS)


__all__ = [
    "ACTIVATIONS", "ADDITIVE", "Bilinear", "CASTS", "CONSTANT_FILLS", "COPIES",
    "ELEMENTWISE_FUNCTIONS", "EMPTY_FILLS", "EXPANDS",
    "FILL_VALUE_ARGUMENTS", "INDEX_ARGUMENTS", "KNOWN_NONLINEAR", "LINEAR_GATHERS",
    "LINEAR_JOINS", "LINEAR_MAPS", "MATMULS", "MATRIX_PRODUCTS", "NORMALISATION_OPS",
    "NORM_LAYERS", "NORM_REDUCTIONS", "NORM_SCALE_CHAIN", "OUTPUT_PATH_LINEAR", "PERMUTES",
    "RANDOM_FILLS", "RELAYOUT_TARGETS", "RESHAPES", "RESHAPE_TARGETS", "SCALINGS",
    "SELECT_TARGETS", "SHAPE_ONLY", "SIZE_VALUES", "SLICES", "SLICE_TARGETS", "SOFTMAXES",
    "SQUARE_REDUCTIONS", "TENSOR_SHAPED_FILLS", "TRANSPOSES", "UNARY_FUNCTIONS", "UPDATE_STEPS",
    "VALUE_PRESERVING", "VIEWS", "calls", "fill_value", "is_view", "op_name"]
