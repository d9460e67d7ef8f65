"""A converted layer's plan under ``torch.compile``, asked for with ``convert(..., compile=)``.

The layer's decisions (its guards, the race against the code as written, fallbacks) stay eager
Python; only the plan it runs is compiled, as one graph that the compiler fuses and plans memory
for (the block op traces plain batched products there). Each layer compiles through its own
entry graph, whose generated code is its own, so TorchDynamo's per-code recompile limit counts
one layer's shapes, not every layer's. Graphs are specialised per (batch, length), as the eager
plan's are: a new shape compiles once, and past the recompile limit new shapes run eagerly,
which the report says. A compiler that fails on a call leaves that layer eager, also said.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from .errors import CompileError, ConversionError, first_line
from .validation import InvalidInputError

#: ``convert(compile=True)`` means this backend.
DEFAULT_BACKEND = "inductor"


def compiler_backend(value) -> str | None:
    """``convert``'s ``compile`` argument as a ``torch.compile`` backend name (``None``: eager),
    or an ``InvalidInputError`` saying what it takes."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_BACKEND
    if isinstance(value, str) and value:
        from torch._dynamo import list_backends
        known = list_backends(exclude_tags=())
        if value not in known:
            raise InvalidInputError(
                f"compile={value!r} names no torch.compile backend; the backends here are "
                f"{', '.join(sorted(known))} (compile=True means {DEFAULT_BACKEND!r}, "
                "compile=None runs eagerly).")
        return value
    raise InvalidInputError(
        f"compile must be None, a bool or a torch.compile backend name, got {value!r} "
        f"(compile=True means {DEFAULT_BACKEND!r}).")


class CompiledPlan:
    """The compiled entries of the layers sharing one converted state, by layer key; ``broken``
    says why the layer runs eagerly after a compiler failure ("" while it compiles)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.broken = ""
        self.error: Exception | None = None     # the compiler's failure, when ``broken``
        self.shapes: set = set()        # the call signatures compiled so far
        self.batches: set[int] = set()  # the batch sizes whose plans ran compiled
        self._entries: dict[tuple[int, int], Callable] = {}

    def fresh(self) -> "CompiledPlan":
        """The same choice for a copied layer, which compiles its own entries."""
        return CompiledPlan(self.backend)

    @property
    def name(self) -> str:
        return f"torch.compile ({self.backend})"

    def full(self, signature: tuple) -> bool:
        """Whether a call of ``signature`` (its shapes, dtypes, gradient recording) would
        compile past TorchDynamo's recompile limit, where TorchDynamo would run it eagerly
        without a word: the layer runs it eagerly itself and says so."""
        if signature in self.shapes:
            return False
        return len(self.shapes) >= torch._dynamo.config.recompile_limit

    def __call__(self, key: int, tensors: list, signature: tuple, eager: Callable):
        """The plan on ``tensors`` (the layer's weights, then its inputs) through the layer
        ``key``'s compiled entry. A call the compiler fails on runs ``eager`` and leaves the
        layer eager (``broken``); an error the eager plan raises too is the plan's own, and is
        raised as it is."""
        entry = self._entries.get((key, len(tensors)))
        if entry is None:
            entry = self._entries[(key, len(tensors))] = self._entry(key, len(tensors))
        try:
            out = entry(*tensors)
        except ConversionError:
            raise
        except Exception as e:      # noqa: BLE001 - the compiler's failure: eager says whose
            out = eager()           # the plan's own error, where the plan fails eagerly too
            self.error = e
            self.broken = (f"{self.name} failed on a call ({_described(e)}); the layer runs "
                           "eagerly since")
            return out
        self.shapes.add(signature)
        return out

    def _entry(self, key: int, n: int) -> Callable:
        """``torch.compile`` of a graph of ``n`` tensors calling the layer ``key``'s plan as one
        traced call (``converted._run_in_graph``), with its own generated code."""
        from .converted import _run_in_graph    # converted imports this module
        graph = torch.fx.Graph()
        tensors = [graph.placeholder(f"t{i}") for i in range(n)]
        graph.output(graph.call_function(_run_in_graph, (key, *tensors)))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        return torch.compile(gm, backend=self.backend, dynamic=False)


def compiler_off() -> bool:
    """Whether ``torch.compile``'d code runs eagerly now (TorchDynamo disabled, or the stance
    ``force_eager``): a plan called then runs eagerly, and no report may say it was compiled."""
    if torch._dynamo.config.disable:
        return True
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    return stance == "force_eager"


def _described(error: Exception) -> str:
    """A compiler failure as ``Type: first line``, of the backend's own error where TorchDynamo
    wraps it (its first line names only the backend)."""
    inner = getattr(error, "inner_exception", None) or error
    return f"{type(inner).__name__}: {first_line(inner)[:200]}"


def signature(tensors: list) -> tuple:
    """What TorchDynamo guards a plan call on that makes it compile again: each tensor's shape,
    strides, dtype and device, and whether gradients are recorded."""
    return (torch.is_grad_enabled(),
            *((tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors))


def compile_plan(module: torch.nn.Module, state, args: tuple, kwargs: dict, backend: str) -> str:
    """Run the converted ``module``'s plan (its ``ConvertedState``) under ``torch.compile`` with
    ``backend``, checked on the layer's example call ``args``/``kwargs``: a backend failing
    there raises ``CompileError`` now rather than leave the layer eager at its first real call.
    Returns the report's note: compiled, and how far from the eager plan on the example."""
    if state.compile_break:
        return (f"compile={backend!r} asked for torch.compile, and its plan runs eagerly: "
                f"{state.compile_break}")
    where = state._where()
    if state.recipe is not None:
        state.recipe.compiler = backend     # a pickled layer compiles again
    with torch.no_grad():
        eager = module(*args, **kwargs)
        state.compiled = CompiledPlan(backend)
        with torch.compiler.set_stance("default"):      # inside convert's eager block
            off = compiler_off()
            compiled = eager if off else module(*args, **kwargs)
    plan = state.compiled
    if off:
        return (f"its plan runs under {plan.name} where TorchDynamo is on; it is off here "
                "(torch._dynamo.config.disable), so it runs eagerly")
    if plan.broken:
        raise CompileError(
            f"{where}: {plan.broken.split('; ')[0]} at its example inputs. On a CPU, inductor "
            "needs a working C++ compiler; convert without compile= to run the plan eagerly, "
            "or name another torch.compile backend.") from plan.error
    note = (f"its plan runs under {plan.name}, compiled for each (batch, length) at its first "
            "call there")
    if plan.shapes:
        note += (f"; on the example inputs its outputs are within a relative RMS of "
                 f"{_difference(compiled, eager):.1e} of the eager plan's")
    return note


def _difference(actual, expected) -> float:
    """The largest relative RMS difference between the tensors of two outputs."""
    from .testing import rel_rms_error
    pairs = zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected))
    return max((rel_rms_error(a, e) for a, e in pairs
                if isinstance(a, torch.Tensor) and a.is_floating_point()), default=0.0)
