"""Numerical comparison helpers shared by the test suite, the benchmarks and ``convert``'s checks."""
from __future__ import annotations

import copy
import statistics
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Relative RMS error allowed between two computations that are mathematically equal.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)``, computed in float64 (0 when both are 0)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    num = torch.linalg.vector_norm(a - e)
    den = torch.linalg.vector_norm(e)
    if den == 0:
        return float(num)
    return float(num / den)


def outputs_and_grads(fn, tensors, options, *, output_final_state: bool, seed: int,
                      cotangent_dtype: torch.dtype):
    """Run a runtime op and differentiate a random projection of its outputs.

    Returns ``(o, final_state, {name: (input, gradient)})`` for every tensor argument
    (positional ones named ``"input i"``, then tensor options by name; an unused input gets a
    zero gradient). The projection weights are representable in ``cotangent_dtype``, so a fast
    op and its float64 reference receive the same output gradients.
    """
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    options = {k: (v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) else v)
               for k, v in options.items()}
    o, final = fn(*tensors, output_final_state=output_final_state, **options)
    assert (final is None) == (not output_final_state)
    g = torch.Generator().manual_seed(seed + 1)

    def project(x):
        weights = torch.randn(x.shape, generator=g, dtype=torch.float64).to(cotangent_dtype)
        return (x.double() * weights.to(device=x.device, dtype=torch.float64)).sum()

    loss = project(o) + (project(final) if final is not None else 0.0)
    leaves = {f"input {i}": t for i, t in enumerate(tensors)}
    leaves.update({k: v for k, v in options.items() if isinstance(v, torch.Tensor)})
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return o, final, {name: (x, torch.zeros_like(x) if gr is None else gr)
                      for (name, x), gr in zip(leaves.items(), grads)}


#: Inputs over which the precision criterion takes its medians (see ``no_worse_than_original``).
CRITERION_SAMPLES = 5
#: Inputs over which ``assert_within_precision_criterion`` judges again a quantity over the bound.
CRITERION_CONFIRM_SAMPLES = 15


def no_worse_than_original(converted: list[float], original: list[float], *,
                           factor: float = 2.0, slack: float = 1e-6) -> tuple[bool, float, float]:
    """The precision criterion where rounding is amplified (Newton–Schulz in fp32/bf16).

    ``converted`` and ``original`` are one quantity's errors against a float64 evaluation of the
    same function, on the same ``CRITERION_SAMPLES`` inputs: the converted code may err at most
    ``factor`` times as much as the original code, plus ``slack``. Medians over inputs, because
    one input's error is a random draw of rounding (two correct low-precision implementations
    differ by 2-3x on single inputs now and then) while a real fault shifts the median.
    Returns ``(ok, median converted error, bound)``.
    """
    got = statistics.median(converted)
    bound = factor * statistics.median(original) + slack
    return got <= bound, got, bound


def module_outputs_and_grads(module: torch.nn.Module, x: torch.Tensor) -> tuple:
    """The output and the gradient of a fixed random projection of it w.r.t. the input and
    every parameter; a gradient that does not reach a tensor (None) is the zero gradient."""
    x = x.clone().requires_grad_(True)
    out = module(x)
    params = [p for p in module.parameters()]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), [x, *params], allow_unused=True)
    names = ["x", *[n for n, _ in module.named_parameters()]]
    return out, {n: torch.zeros_like(t) if g is None else g
                 for n, g, t in zip(names, grads, [x, *params])}


def assert_no_worse_than_original(errors_on: Callable[[int], dict], *,
                                  samples: int = CRITERION_SAMPLES,
                                  confirm: int = CRITERION_CONFIRM_SAMPLES) -> None:
    """The precision criterion judged over inputs ``0, 1, ...``: ``errors_on(i)`` gives each
    quantity's ``(converted error, original error)`` against float64 on input ``i``.

    Medians over ``samples`` inputs (``no_worse_than_original``); a quantity over the bound is
    judged again over ``confirm`` inputs, the first ones among them, the bound unchanged: the
    median of five is a loose estimate — a LaCT layer converted at level 1, 1.2x the original's
    error over sixty inputs, failed one draw of five in fourteen —, while a real fault fails the
    larger sample as well."""
    errors: dict[Any, tuple[list, list]] = {}
    judged = 0
    for n in (samples, max(samples, confirm)):
        for i in range(judged, n):
            for name, (converted, original) in errors_on(i).items():
                errors.setdefault(name, ([], []))
                errors[name][0].append(converted)
                errors[name][1].append(original)
        judged = n
        verdicts = {name: no_worse_than_original(c, o) for name, (c, o) in errors.items()}
        failed = [(name, err, bound) for name, (ok, err, bound) in verdicts.items() if not ok]
        if not failed:
            return
    name, err, bound = failed[0]
    raise AssertionError(f"{name}: median error {err:.3g} > {bound:.3g} (2x the original's + "
                         f"1e-6, over {judged} inputs)")


def assert_within_precision_criterion(conv: torch.nn.Module, ref32: torch.nn.Module,
                                      x: torch.Tensor) -> None:
    """fp32 with Newton–Schulz: ``err(conv, ref64) <= 2 err(ref32, ref64) + 1e-6`` for the
    output and every gradient, ``ref64`` the float64 copy of ``ref32`` (same weights), judged on
    ``x`` and inputs of its shape drawn after it (``assert_no_worse_than_original``)."""
    ref64 = copy.deepcopy(ref32).double()
    gen = torch.Generator().manual_seed(int(x.shape[0] * 1000 + x.shape[1]))
    inputs = drawn_after(x, gen)
    assert_no_worse_than_original(lambda i: _criterion_errors(conv, ref32, ref64, inputs(i)))


def drawn_after(first: torch.Tensor, gen: torch.Generator) -> Callable[[int], torch.Tensor]:
    """Input ``i`` of a judgment over inputs: ``first``, then inputs of its shape and dtype
    drawn from ``gen`` in order, each drawn once however often it is asked for."""
    inputs = [first]

    def input_at(i: int) -> torch.Tensor:
        while len(inputs) <= i:
            inputs.append(torch.randn(first.shape, generator=gen, dtype=first.dtype))
        return inputs[i]
    return input_at


def _criterion_errors(conv, ref32, ref64, xs: torch.Tensor) -> dict:
    """The converted and the original code's errors against ``ref64`` on ``xs``, for the output
    and every gradient."""
    out_c, g_c = module_outputs_and_grads(conv, xs)
    out_r, g_r = module_outputs_and_grads(ref32, xs)
    out_64, g_64 = module_outputs_and_grads(ref64, xs.double())
    assert g_c.keys() == g_64.keys()
    pairs = [("output", out_c, out_r, out_64)] + [(n, g_c[n], g_r[n], g_64[n]) for n in g_64]
    return {name: (rel_rms_error(got, exact), rel_rms_error(original, exact))
            for name, got, original, exact in pairs}


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched while it is active (forward and backward): how much work
    a converted layer does in Python, which must not grow with the sequence length."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def training_step_ops(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Ops one forward and backward of ``module(x).sum()`` dispatches, after a warm-up step at
    this shape (which builds whatever the module prepares per shape)."""
    module(x).sum().backward()
    module.zero_grad()
    with CountOps() as counter:
        module(x).sum().backward()
    return counter.count


def same_value(x, y) -> bool:
    """Two values a layer returned agree: tensors of one shape and dtype within the dtype's
    tolerance (exactly, for integers and bools), anything else equal."""
    if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
        return False
    if not isinstance(x, torch.Tensor):
        return bool(x == y)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point() and x.numel():
        return rel_rms_error(x, y) <= TOLERANCE.get(x.dtype, 1e-5)
    return torch.equal(x, y)


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE[dtype]


__all__ = ["rel_rms_error", "same_value", "tolerance", "TOLERANCE", "outputs_and_grads",
           "no_worse_than_original", "CRITERION_SAMPLES", "CRITERION_CONFIRM_SAMPLES", "CountOps",
           "training_step_ops"]
