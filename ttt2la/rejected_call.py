"""A call the layer's own code fails on, raised as a ``ConversionError`` that points at the line.

A converted layer runs the user's code around the loop (and inside it) as traced graphs. A call
that code cannot take — an input of another dtype than the weights, an empty axis a reshape with
``-1`` cannot infer — fails inside a graph, where torch's message names a generated line, not
the user's. ``rejected`` re-runs the failing graph node by node (only once it has failed) to find
the op that raised, and returns a ``RejectedCallError`` naming the user's source line, what the
layer was converted for and what to do. The error is also an instance of the original error's
class (a ``RuntimeError`` stays one to an ``except RuntimeError``), chained as its cause.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils.checkpoint

from .errors import ConversionError, RejectedCallError
from .ir import LOOP_MODULE, node_src

_CLASSES: dict[type, type] = {}


class _Locate(torch.fx.Interpreter):
    """Runs a graph, remembering the node that is running."""

    node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node):
        self.node = n
        return super().run_node(n)


#: Exceptions torch raises to steer a computation, not to report a failure: the early stop of a
#: non-reentrant activation checkpoint's recomputation, once it has what it saved.
_STEERING = tuple(c for c in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),)
                  if c is not None)


def steering(error: BaseException) -> bool:
    """Is ``error`` torch steering the call (``_STEERING``), to pass on untouched rather than
    judge as a failure of the plan or of the layer?"""
    return isinstance(error, _STEERING)


def failing_node(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.Node | None:
    """The node of ``gm`` that raises on ``inputs`` (None when the re-run does not fail); a
    graph called with its sizes (``SizedCall``) is run as its graph takes them."""
    if not isinstance(gm, torch.fx.GraphModule):
        gm, inputs = gm.gm, gm.inputs(inputs)
    locate = _Locate(gm)
    try:
        with torch.no_grad():
            locate.run(*inputs)
    except Exception:
        return locate.node
    return None


def fails_in_loop(gm: torch.fx.GraphModule, inputs: list) -> bool:
    """Whether ``gm(*inputs)`` fails in its converted loop rather than in the layer's own code
    around it."""
    node = failing_node(gm, inputs)
    return node is not None and node.op == "call_module" and node.target == LOOP_MODULE


def _dual_class(cls: type) -> type:
    """``RejectedCallError`` that is also a ``cls``: cached, one per original class."""
    dual = _CLASSES.get(cls)
    if dual is None:
        try:
            dual = type(f"Rejected{cls.__name__}", (RejectedCallError, cls), {})
        except TypeError:                    # a class that cannot be a second base
            dual = RejectedCallError
        _CLASSES[cls] = dual
    return dual


def failed_where(node: torch.fx.Node | None, loop_src: str,
                 implementation: str) -> tuple[str, str, bool]:
    """``(where, what, own)``: the line the failing node came from, how to name it, and whether
    it is the layer's own code outside the loop (which the converted layer runs as written)."""
    if node is not None and node.op == "call_module" and node.target == LOOP_MODULE:
        return loop_src, f"in the loop at {loop_src} (run as {implementation})", False
    src = None if node is None else node_src(node)
    if src is None:
        return "", "in the converted layer", False
    return src.at(), f"at {src.at()}", True


def _told(error: Exception, expected: str) -> tuple[str, str]:
    """The first line of ``error``'s message, and the sentence naming the calls the layer was
    converted for (``expected``; "" when unknown)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return first, f" It was converted for calls with {expected}." if expected else ""


def rejected(error: Exception, gm: torch.fx.GraphModule, inputs: list, *, path: str,
             loop_src: str, implementation: str, expected: str) -> Exception:
    """The error to raise for ``error``, raised by ``gm(*inputs)``: itself when it is already a
    ``ConversionError``, else a ``RejectedCallError`` of its class naming where it failed."""
    if isinstance(error, ConversionError):
        return error
    where, what, own = failed_where(failing_node(gm, inputs), loop_src, implementation)
    first, converted_for = _told(error, expected)
    why = ("That line is the layer's own code, which the converted layer runs as written, so the "
           "layer as written fails on this call too." if own else
           "The loop's body is the layer's own code; if the layer as written runs this call, "
           "the conversion is at fault: report it with this message.")
    message = (f"the converted {path or 'layer'} failed on this call {what}: "
               f"{type(error).__name__}: {first}. {why}{converted_for} Pass inputs the layer as "
               f"written accepts (the dtype and device of its weights, no empty axis its reshapes "
               f"infer).")
    return _dual_class(type(error))(message, where=where or None)


def conversion_fault(error: Exception, gm: torch.fx.GraphModule, inputs: list, *,
                     loop_src: str, implementation: str) -> str:
    """What failed where, for ``error`` raised by ``gm(*inputs)`` on a call the layer as
    written runs: the converted graphs are at fault, not the line they were traced from."""
    _, what, own = failed_where(failing_node(gm, inputs), loop_src, implementation)
    part = "code around the loop (as traced)" if own else "layer"
    first, _ = _told(error, "")
    return f"the converted {part} failed on this call {what} ({type(error).__name__}: {first})"


def rejected_as_written(error: Exception, *, path: str, why: str, expected: str) -> Exception:
    """The error to raise for ``error``, raised by the layer's code run as written (``why`` says
    why it ran so): itself when it is a ``ConversionError``, else a ``RejectedCallError`` of its
    class naming the user's line it came from."""
    if isinstance(error, ConversionError):
        return error
    from .frontend.capture import user_frame

    at = user_frame(error) or ""
    first, converted_for = _told(error, expected)
    message = (f"the converted {path or 'layer'} ran its code as written ({why}), and that code "
               f"failed on this call{' at ' + at if at else ''}: {type(error).__name__}: "
               f"{first}. The layer as written fails on this call too.{converted_for} Pass inputs "
               f"the layer as written accepts (the dtype and device of its weights, the sizes its "
               f"code reshapes to).")
    return _dual_class(type(error))(message, where=at.split(" (`")[0] or None)


__all__ = ["rejected", "rejected_as_written", "conversion_fault", "failed_where", "failing_node",
           "fails_in_loop"]
