"""What a shapes-only trace cannot stand for, refused by name and source line.

ttt2la traces a layer with fake tensors — shapes, no values — and runs the converted layer at
every shape from that trace. Two kinds of code defeat it without a clear error from torch:

* values read out of the data that then steer sizes or arithmetic (``.item()``, ``.tolist()``,
  ``nonzero``, boolean-mask indexing, ``unique``): the trace holds *unbacked* symbols where the
  numbers would be, and what fails later (vmap, lifting, the roll-up) says nothing of the cause;
* NumPy on a traced tensor (``np.tanh(x.numpy())``), which crashes the process under fake
  tensors instead of raising.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..ir import describe_op


class NumPyDuringTrace(RuntimeError):
    """NumPy was called on a tensor while the layer was being traced."""


@contextlib.contextmanager
def no_numpy():
    """Make ``Tensor.numpy()`` (and so ``np.asarray(t)``) raise while a layer is traced."""
    original = torch.Tensor.numpy

    def refuse(self, *args, **kwargs):
        raise NumPyDuringTrace(
            "Tensor.numpy() was called while tracing: NumPy computations are invisible to "
            "make_fx and run on no data here")

    torch.Tensor.numpy = refuse
    try:
        yield
    finally:
        torch.Tensor.numpy = original


def data_dependent_node(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first node whose value or size is a number read out of the data, if any."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        try:
            found = val is not None and free_unbacked_symbols(val)
        except Exception:          # a value the symbol walk does not understand: not symbolic
            found = False
        if found:
            return node
    return None


def data_dependent_message(node: torch.fx.Node, layer: str) -> str:
    """Why the layer is refused, naming the op and the line that read the data."""
    return (f"{layer}: {describe_op(node)} reads a number out of the data (`.item()`, `.tolist()`, "
            "`nonzero`, boolean-mask indexing or `unique`), and the size or value it gives "
            "steers the computation; ttt2la traces the layer with shapes only and runs the "
            "converted layer at every shape from that trace. Compute that value from sizes or "
            "Python numbers, or move it out of the layer's forward.")


__all__ = ["NumPyDuringTrace", "no_numpy", "data_dependent_node", "data_dependent_message"]
