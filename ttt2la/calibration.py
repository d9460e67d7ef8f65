"""Calibration data at the loop: what a lossy pass measures to fold what it removes.

``convert(model, calibration=...)`` takes model inputs (the example inputs when none are given).
For every recognized layer they are turned into the loop's own inputs — initial states and
invariants by name, at the batch size the layer's body was traced at — by running the user's
code around the loop (the layer's outer graph) with a recorder in the loop's place. A pass then
asks for the values of body nodes over the calibration chunks (``chunk_values``): the body runs
chunk by chunk, exactly as the loop would, carrying its states.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from .errors import ConversionError
from .ir import LOOP_MODULE, TTTProgram, layout_free

MAX_SAMPLES = 4          # calibration pieces per layer: enough for means, bounded in cost


class _Captured(Exception):
    """Raised by the recorder to stop the outer graph once the loop's inputs are known."""


class _Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.args: tuple | None = None

    def forward(self, *args):
        self.args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        raise _Captured


def layer_inputs(model: torch.nn.Module, modules: Sequence[torch.nn.Module], inputs: tuple,
                 kwargs: dict | None = None) -> list[tuple[tuple, dict]]:
    """The ``(args, kwargs)`` each of ``modules`` is first called with when ``model`` runs on
    ``inputs`` (one forward pass for all of them)."""
    seen: dict[int, tuple] = {}

    def hook(i):
        def record(_m, args, kw):
            seen.setdefault(i, (tuple(args), dict(kw)))
        return record

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, m in enumerate(modules)]
    try:
        with torch.no_grad():
            model(*inputs, **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - the user's model rejected the calibration data
        raise ConversionError(
            f"{type(model).__name__} fails on the calibration inputs ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); pass calibration inputs the model "
            "accepts, shaped like its example inputs.") from e
    finally:
        for handle in handles:
            handle.remove()
    if len(seen) < len(modules):
        raise ConversionError("a TTT layer is not called when the model runs on the "
                              "calibration inputs; pass calibration inputs that reach it.")
    return [seen[i] for i in range(len(modules))]


@dataclass
class LoopCalibration:
    """The loop's inputs on calibration data: one ``{name: tensor}`` per piece of the batch."""

    samples: list[dict[str, torch.Tensor]]
    source: str = "calibration"          # "calibration" or "example": what was measured
    layer_args: tuple = ()               # the layer's own inputs (for drift measurements)
    layer_kwargs: dict = field(default_factory=dict)

    @classmethod
    def capture(cls, rl, args: tuple, kwargs: dict, source: str = "calibration"
                ) -> "LoopCalibration":
        """Run the layer's outer graph on ``(args, kwargs)`` in pieces of the traced batch size
        and record what its loop receives. Where the graph, fitted at the probe lengths, fails
        at the inputs' own length (a size the code clamps there, ``min(L, 64)``, which the
        length's checks then leave to the code as written), the inputs are resized to the
        length it was traced at."""
        layout = rl.layout
        spelled_args, spelled_kwargs = layout.spelled(tuple(args), dict(kwargs))
        flat, _ = pytree.tree_flatten((tuple(spelled_args), dict(spelled_kwargs)))
        B, L = layout.sizes(flat)
        try:
            samples = _samples(rl, flat, B, L)
        except _GraphFailed as failed:
            if L == rl.L0:
                raise ConversionError(
                    f"the code around the loop of {rl.path or 'the model'}, as traced, fails on "
                    f"the {source} inputs ({failed.error}); this is a bug in ttt2la, please "
                    "report it with the layer's code") from None
            samples = _samples(rl, flat, B, rl.L0)
        return cls(samples, source, tuple(spelled_args), dict(spelled_kwargs))

    def program_inputs(self, program: TTTProgram, sample: dict) -> tuple[list, list]:
        """The initial states and invariants of ``program`` (a rewritten one may have fewer)."""
        states0 = [sample[s.name].contiguous() for s in program.states]
        invariants = [sample[i.name] for i in program.invariants]
        return states0, invariants

    def chunk_values(self, program: TTTProgram, nodes: Sequence[torch.fx.Node]
                     ) -> list[list[torch.Tensor]]:
        """For every node, its value in every full calibration chunk (all samples, in order)."""
        from .lowering.chunking import chunk_streams

        values: list[list[torch.Tensor]] = [[] for _ in nodes]
        n_s = len(program.states)
        for sample in self.samples:
            states, invariants = self.program_inputs(program, sample)
            streams, layout = chunk_streams(program, invariants)
            n_full = layout.n_chunks - (1 if layout.partial else 0)
            for j in range(n_full):
                env = _Recording(program.body, nodes)
                with torch.no_grad():
                    res = env.run(*states, *[x[j] for x in streams], *invariants)
                for k, v in enumerate(env.seen):
                    values[k].append(v)
                if j < layout.n_chunks - 1 or program.last_chunk == "update":
                    states = list(res[:n_s])
        return values


class _GraphFailed(Exception):
    """The outer graph, instantiated at a length, fails there; ``error`` says how."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = f"{type(error).__name__}: {error}"


def _samples(rl, flat: list, B: int, L: int) -> list[dict[str, torch.Tensor]]:
    """The loop's inputs when the outer graph, instantiated at length ``L``, runs on ``flat``
    resized to it, one sample per piece of the traced batch size (``_GraphFailed``: the graph
    fails there)."""
    from .frontend.recognize import _inputs_at, params_and_buffers

    layout, unit = rl.layout, rl.layout.batch_unit
    rows = rl.B0 * unit
    names = [s.name for s in rl.program.states] + [i.name for i in rl.program.invariants]
    gm = rl.outer.instantiate(rl.B0, L)
    recorder = _Recorder()
    setattr(gm, LOOP_MODULE, recorder)
    params = params_and_buffers(rl.candidate.module)
    samples = []
    for start in range(0, max(B * unit, 1), rows):
        piece = [x.narrow(layout.batch_axis[i], start, min(rows, B * unit - start))
                 if isinstance(x, torch.Tensor) and i in layout.batch_axis else x
                 for i, x in enumerate(flat)]
        piece = _inputs_at(piece, layout, rows, L)
        try:
            with torch.no_grad():
                gm(params, *piece)
        except _Captured:
            pass
        except Exception as error:      # the graph's sizes, fitted elsewhere, fail here
            raise _GraphFailed(error) from None
        if recorder.args is None:
            raise ConversionError(f"the loop of {rl.path or 'the model'} did not run on the "
                                  "calibration inputs")
        samples.append(dict(zip(names, recorder.args)))
        recorder.args = None
        if len(samples) >= MAX_SAMPLES:
            break
    return samples


class _Recording(torch.fx.Interpreter):
    """Runs a body and keeps the values of the requested nodes."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]):
        super().__init__(gm)
        self.wanted = {n: i for i, n in enumerate(nodes)}
        self.seen: list = [None] * len(nodes)

    def call_function(self, target, args, kwargs):
        # the chunks are slices laid out otherwise than the traced ones
        return super().call_function(layout_free(target), args, kwargs)

    def run_node(self, n: torch.fx.Node):
        value = super().run_node(n)
        if n in self.wanted:
            self.seen[self.wanted[n]] = value.detach() if isinstance(value, torch.Tensor) \
                else value
        return value


__all__ = ["LoopCalibration", "layer_inputs", "MAX_SAMPLES"]
