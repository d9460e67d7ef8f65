"""The intermediate representation of one recognized TTT inner loop: ``TTTProgram``.

A program is the loop *body* as an aten-level ``torch.fx.GraphModule`` plus what the frontend
learned about it: which body inputs are carried states, chunk streams or loop invariants, the
chunk size, the update/apply order and where every node came from in the user's source.

Body calling convention (every pass and every executor relies on it)::

    body(*states_in, *streams, *invariants) -> (*states_out, *chunk_outputs)

* ``states_in[i]`` / ``states_out[i]`` — the carried value before / after one chunk
  (fast weights, momentum buffers), described by ``program.states[i]``.
* ``streams[i]`` — the slice of a loop-invariant tensor that belongs to the current chunk,
  described by ``program.streams[i]``: ``source`` (index into the invariants the slice is
  taken from), ``axis`` (token axis of that source) and ``per_token`` (``select`` — the token
  axis is removed — rather than a ``slice`` of ``chunk_size`` tokens).
* ``invariants[i]`` — tensors the loop reads unchanged in every iteration (projections, lrs,
  initial norms, Θ when frozen ...), described by ``program.invariants[i]``. The whole
  sequences that streams are sliced from are invariants too (the body may not use them
  directly: their placeholders are then simply unused), so ``invariants`` is everything an
  executor needs besides the initial states.
* ``chunk_outputs[i]`` — what one chunk contributes to the layer output, concatenated over
  chunks along ``program.outputs[i].axis`` (or stacked there when ``per_token``).

Placeholders carry ``node.meta[KIND]`` (``"state" | "stream" | "invariant"``) and
``node.meta[NAME]``; every node that came from user code carries ``node.meta[SRC]``, a
``SourceLoc`` of the innermost user frame that produced it.

Iteration semantics over ``N = ceil(L / chunk_size)`` chunks (``N = L`` for per-token loops)::

    S = initial_states
    for j in range(N):
        S_next, Y_j = body(S, X_j, P)
        if order == "exclusive":   # chunk j is read through the state left by chunks < j
            ...Y_j only reads S (the states before the update)
        if j < N - 1 or last_chunk == "update":
            S = S_next
    final_states = S

``order`` is ``"exclusive"`` when the chunk outputs depend only on ``states_in`` (LaCT's
apply-then-update) and ``"inclusive"`` when they read ``states_out`` (update-then-apply, the
per-token TTT form). ``last_chunk`` is ``"apply_only"`` when the last chunk is applied without
updating (LaCT), ``"update"`` otherwise.

Outer-graph calling convention (the layer with its loop rolled up; the frontend builds it, a
converted layer runs it)::

    outer(params_and_buffers(module), *flat_inputs) -> the layer's outputs

* ``params_and_buffers(module)`` — the layer's parameters and buffers by name (in that
  order), so the same graph runs with any weights; ``flat_inputs`` — the layer's positional
  and keyword inputs, flattened as a pytree.
* The loop is one node ``call_module(LOOP_MODULE, (*initial_states, *invariants))``: the
  initial values of the recognized program's states, then its invariants, in the order of its
  ``states`` and ``invariants`` (``loop_interface``). The submodule standing at ``LOOP_MODULE``
  returns ``(output, *final_states)``, read by ``getitem``: ``output`` the chunk outputs joined
  as ``outputs[0]`` says (laid out in memory as ``outputs[0].memory_order``), then the final
  value of each state. Passes may drop states or invariants from the rewritten program, so
  whoever runs it binds the call's arguments by name (``bind_loop_args``); a state the rewritten
  program no longer carries returns its initial value.
  The call stands for every iteration and for a last chunk the user's code applies after the
  loop; a state the first iteration does not read starts as ``zeros``, and code that only
  initialises a state in the first iteration runs before the call.
* The graph is specialised per shape: a ``ShapeTemplate`` makes the outer graph (and the body)
  at batch size B and length L, and a ``SizeReader`` reads (B, L) off a call's inputs.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import torch
import torch.fx
from torch.fx import _lazy_graph_module
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

KIND = "ttt2la_kind"
#: Meta flag of the ``zeros`` a state starts from when the first iteration skips its use.
SKIPPED_FIRST = "ttt2la_skipped_first"
NAME = "ttt2la_name"
SRC = "ttt2la_src"
#: A product summed over an axis that the frontend rewrote as a ``bmm`` for the matchers
#: (``frontend/summed_products.py``): the chain it became, on every node of it; which operand a
#: node reads (0: ``a``, 1: ``b``); the summed axes (from the right) and ``keepdim``, on the
#: chain's result. ``lowering/written_products.py`` puts the code's own ops back from them.
PRODUCT_CHAIN = "ttt2la_product_chain"
PRODUCT_OPERAND = "ttt2la_product_operand"
SUMMED_PRODUCT = "ttt2la_summed_product"
LOOP_MODULE = "ttt_loop"      # the submodule the outer graph calls in the place of the loop
#: On an invariant's placeholder: its value, float64, when the code before the loop computes it
#: from no input at all (``I = torch.eye(d)``) — the same tensor on every call, which a lift
#: that evaluates the body on random inputs uses instead of a random one.
INPUT_FREE = "ttt2la_input_free"

StateRole = Literal["final", "theta", "momentum", "other"]


@dataclass(frozen=True)
class SourceLoc:
    """One user source line: where an op, a loop or a state update was written."""

    file: str
    line: int
    function: str
    code: str = ""

    @property
    def short_file(self) -> str:
        parts = self.file.replace("\\", "/").split("/")
        return "/".join(parts[-2:]) if len(parts) > 1 else self.file

    def __str__(self) -> str:
        return f"{self.short_file}:{self.line} in {self.function}"

    def full(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.code}".rstrip(": ")

    def at(self) -> str:
        """``file:line (`code`)``, how refusals point at the line."""
        return f"{self.file}:{self.line}" + (f" (`{self.code}`)" if self.code else "")


@dataclass
class StateSpec:
    """A loop-carried tensor. ``role`` is filled by ``ttt2la.analysis.roles``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: StateRole = "other"
    src: SourceLoc | None = None          # where the loop writes it


@dataclass
class StreamSpec:
    """A per-chunk slice of an invariant tensor (q, k, v, lr, momentum gates ...)."""

    name: str
    source: int                            # index into ``TTTProgram.invariants``
    axis: int                              # token axis of the source tensor
    per_token: bool = False                # ``select`` of one token instead of a slice
    role: str = ""                         # "q", "k", "v", "lr", "momentum" ... (for reports)


@dataclass
class InvariantSpec:
    """A tensor every iteration reads unchanged."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class OutputSpec:
    """A per-chunk output, joined over chunks along ``axis`` of the assembled tensor.

    ``memory_order`` lists the assembled tensor's dims from outermost to innermost in memory,
    as the user's code laid it out (``zeros_like`` of a transposed tensor keeps the
    transposition): the code after the loop was traced on that layout.
    """

    name: str
    axis: int
    per_token: bool = False
    memory_order: tuple[int, ...] | None = None
    #: the iterations' outputs are items of another count than their chunks' tokens (one per
    #: chunk, a summary beside each chunk's tokens): joined whole, never cut to the length
    items: bool = False


@dataclass
class TTTProgram:
    """One recognized TTT inner loop, ready for passes, analysis and lowering."""

    body: torch.fx.GraphModule
    states: list[StateSpec]
    streams: list[StreamSpec]
    invariants: list[InvariantSpec]
    outputs: list[OutputSpec]
    chunk_size: int
    order: Literal["exclusive", "inclusive"] = "exclusive"
    last_chunk: Literal["apply_only", "update"] = "update"
    module_path: str = ""
    loop_src: SourceLoc | None = None      # the ``for`` statement
    function: str = ""                     # function that holds the loop
    notes: list[str] = field(default_factory=list)
    single_step: bool = False              # one update over all tokens, then every token reads
    partial_chunk: str = ""                # what a partial chunk computes unlike a padded one

    @property
    def one_token(self) -> bool:
        """Whether every iteration reads one token of each stream: selected (``per_token``, its
        token axis removed) or sliced one wide (``x[:, t:t+1]``, a chunk of one token that keeps
        a unit token axis). Either is the per-token recurrence; only the layout differs."""
        if not self.streams or self.single_step:
            return False
        per_token = [s.per_token for s in self.streams]
        return all(per_token) or (self.chunk_size == 1 and not any(per_token))

    # -- body plumbing shared by passes, analysis and executors --------------------------
    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.body.graph.nodes if n.op == "placeholder"]

    def output_node(self) -> torch.fx.Node:
        return next(n for n in reversed(self.body.graph.nodes) if n.op == "output")

    def state_inputs(self) -> list[torch.fx.Node]:
        return [n for n in self.placeholders() if n.meta.get(KIND) == "state"]

    def stream_inputs(self) -> list[torch.fx.Node]:
        return [n for n in self.placeholders() if n.meta.get(KIND) == "stream"]

    def invariant_inputs(self) -> list[torch.fx.Node]:
        return [n for n in self.placeholders() if n.meta.get(KIND) == "invariant"]

    def state_outputs(self) -> list[torch.fx.Node]:
        return list(self.output_node().args[0][: len(self.states)])

    def chunk_outputs(self) -> list[torch.fx.Node]:
        return list(self.output_node().args[0][len(self.states):])

    def set_outputs(self, states_out, chunk_outputs) -> None:
        """Replace the body's returned values (used by passes), then clean up the graph."""
        out = self.output_node()
        out.args = (tuple(states_out) + tuple(chunk_outputs),)
        self.recompile()

    def recompile(self) -> None:
        self.body.graph.eliminate_dead_code()
        self.body.graph.lint()
        self.body.recompile()

    def state_index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.states) if s.name == name)

    def states_with_role(self, role: str) -> list[int]:
        return [i for i, s in enumerate(self.states) if s.role == role]

    def clone(self) -> "TTTProgram":
        """A deep copy whose body graph can be rewritten without touching this one."""
        return self.relabeled(body=graph_module(self.body, copy_graph(self.body.graph)))

    def relabeled(self, body=None) -> "TTTProgram":
        """A copy whose specs (roles, names, notes) can be changed without touching this one,
        sharing this one's body graph (or holding ``body``): copying a graph costs a conversion
        more than anything else after tracing, so only a copy that rewrites it pays for one."""
        return dataclasses.replace(
            self,
            body=self.body if body is None else body,
            states=[dataclasses.replace(s) for s in self.states],
            streams=[dataclasses.replace(s) for s in self.streams],
            invariants=[dataclasses.replace(s) for s in self.invariants],
            outputs=[dataclasses.replace(s) for s in self.outputs],
            notes=list(self.notes),
        )


def loop_interface(program: TTTProgram) -> tuple[list[str], list[str]]:
    """The names of the loop call's arguments: the program's states, then its invariants (taken
    from the program as recognized, before passes rewrite it)."""
    return [s.name for s in program.states], [i.name for i in program.invariants]


def bind_loop_args(interface: tuple[list[str], list[str]],
                   args: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loop call's arguments (``(*initial_states, *invariants)``) by name."""
    state_names, invariant_names = interface
    n = len(state_names)
    return {**dict(zip(state_names, args[:n])), **dict(zip(invariant_names, args[n:]))}


def params_and_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The outer graph's first argument: ``module``'s parameters, then its buffers, by name —
    ``named_parameters()`` then ``named_buffers()``, read at every call of a converted layer
    (a weight may be replaced between calls). Their generators cost a converted layer more than
    its checks on a small call, so the same walk is written out here for modules that walk their
    members as ``nn.Module`` does (``_walked``): pre-order, a module or tensor met again skipped,
    ``None`` entries left out."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if not _walked(module, "", params, buffers, set(), set(), set()):
        return {**dict(module.named_parameters()), **dict(module.named_buffers())}
    params.update(buffers)
    return params


#: What ``named_parameters`` and ``named_buffers`` walk a module tree by.
_WALK = ("named_modules", "_named_members", "named_parameters", "named_buffers", "__hash__",
         "__eq__")
_PLAIN_WALK: dict[type, bool] = {}


def _walks_plainly(cls: type) -> bool:
    """Does ``cls`` walk its members as ``nn.Module`` does (none of ``_WALK`` overridden)?"""
    plain = _PLAIN_WALK.get(cls)
    if plain is None:
        plain = _PLAIN_WALK[cls] = all(getattr(cls, name, None) is getattr(torch.nn.Module, name)
                                       for name in _WALK)
    return plain


def _walked(m: torch.nn.Module, prefix: str, params: dict, buffers: dict, modules: set,
            seen_params: set, seen_buffers: set) -> bool:
    """Add the members of ``m`` and its submodules to ``params`` and ``buffers`` as
    ``named_parameters`` and ``named_buffers`` name them; ``False`` where a module walks its
    members otherwise (then the two are called instead)."""
    if not _walks_plainly(type(m)):
        return False
    modules.add(id(m))
    dot = prefix + "." if prefix else ""
    for name, t in m._parameters.items():
        if t is not None and id(t) not in seen_params:
            seen_params.add(id(t))
            params[dot + name] = t
    for name, t in m._buffers.items():
        if t is not None and id(t) not in seen_buffers:
            seen_buffers.add(id(t))
            buffers[dot + name] = t
    for name, child in m._modules.items():
        if child is not None and id(child) not in modules and \
                not _walked(child, dot + name, params, buffers, modules, seen_params,
                            seen_buffers):
            return False
    return True


class ShapeTemplate(Protocol):
    """A traced graph made generic in the batch size and the sequence length (the frontend's
    ``GraphTemplate``): ``gm`` as traced, ``instantiate(B, L)`` at another shape (``gm`` itself
    where no size changes, unless ``fresh``: a copy the caller may rewrite)."""

    gm: torch.fx.GraphModule

    def instantiate(self, B: int, L: int, fresh: bool = False) -> torch.fx.GraphModule: ...

    def sized(self):
        """One graph for every shape whose sizes are passed with each call: a ``SizedGraph``,
        whose ``at(B, L)`` is that graph called at one shape (``forward``, ``inputs``)."""

    def rewritten(self, rewrite) -> "ShapeTemplate":
        """The template over ``rewrite(gm)``, a copy whose nodes stay in their places."""


class SizeReader(Protocol):
    """Reads the batch size and sequence length off a call's flattened inputs (the frontend's
    ``InputLayout``), in the units a ``ShapeTemplate`` is instantiated at."""

    def sizes(self, flat_inputs: list) -> tuple[int, int]: ...


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dims of ``t`` from outermost to innermost in memory (size-1 dims keep their place)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d) if t.shape[d] > 1 else 0, d)))


def inverse_order(order: tuple[int, ...]) -> list[int]:
    """The permutation that undoes ``order``: ``t.permute(order).permute(inverse) is t``."""
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return inverse


def with_memory_order(t: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """``t``'s values laid out in memory in ``order`` (see ``memory_order``)."""
    if order is None or len(order) != t.dim():
        return t.contiguous()
    return t.permute(order).contiguous().permute(inverse_order(order))


def layout_free(target):
    """``target``, or ``reshape`` for a ``view``: the same values for inputs of any memory layout
    (a trace's ``view`` assumed the traced layout). Functional graphs never write through a view,
    so aliasing is not part of their meaning."""
    if target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
        return torch.ops.aten.reshape.default
    return target


def reshape_views(graph: torch.fx.Graph) -> torch.fx.Graph:
    """Turn every ``view`` of ``graph`` into ``reshape``, in place (see ``layout_free``)."""
    for node in graph.nodes:
        if node.op == "call_function":
            node.target = layout_free(node.target)
    return graph


def placeholder(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    """A placeholder for ``name`` whose argument is named like its node. fx names nodes in snake
    case (a state ``W`` becomes node ``w``, a later input ``w`` node ``w_1``) and its generated
    code binds each argument to its node's name in order (``w = W; w_1 = w``), so an argument
    named unlike its node can read another's value."""
    ph = graph.placeholder(name)
    ph.target = ph.name
    return ph


class _CodeOnFirstUse(_LazyGraphModule):
    """A graph module whose Python code is generated when it first runs or is read. Its first
    run calls the generated ``forward`` itself, as later ones do: fx's own lazy module goes
    through ``__call__`` there, whose wrapper prints the generated code of a graph that raises,
    where ttt2la names the user's line instead."""

    def _lazy_forward(self, *args, **kwargs):
        self.real_recompile()
        return self.forward(*args, **kwargs)

    forward = _lazy_forward


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph)`` whose Python code is generated when it first runs
    or is read, not at once: most graphs a conversion builds are rewritten again, or only read,
    and generating their code was a third of a conversion's time after tracing."""
    return _CodeOnFirstUse(root, graph)


@contextlib.contextmanager
def lazy_graph_modules():
    """Graph modules made by torch inside (``make_fx``'s) generate their code when first run or
    read, as ``graph_module``'s do."""
    original = _lazy_graph_module._LazyGraphModule
    _lazy_graph_module._LazyGraphModule = _CodeOnFirstUse    # the class fx makes them of
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        _lazy_graph_module._LazyGraphModule = original


def quiet_deepcopy(obj):
    """``copy.deepcopy(obj)``, without the deprecation warning torch itself trips when it copies
    the pytree spec a ``make_fx`` graph's code generator holds."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(obj)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes can be rewritten; metadata is shared, not deep-copied
    (it holds fake tensors, which are costly to copy and never mutated)."""
    new = quiet_deepcopy(graph)   # fx copies node by node; meta dicts are copied shallowly
    for old_node, new_node in zip(graph.nodes, new.nodes):
        new_node.meta = dict(old_node.meta)
    return new


def ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every node it is computed from."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def descendants(graph: torch.fx.Graph, sources) -> set[torch.fx.Node]:
    """``sources`` and every node of ``graph`` computed from one of them."""
    found = set(sources)
    for n in graph.nodes:
        if any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def node_src(node: torch.fx.Node) -> SourceLoc | None:
    return node.meta.get(SRC)


#: Python operators as the user writes them.
_OPERATORS = {"add": "`+`", "sub": "`-`", "mul": "`*`", "truediv": "`/`", "floordiv": "`//`",
              "matmul": "`@`", "neg": "`-`", "pow": "`**`", "getitem": "indexing `[...]`",
              "setitem": "an assignment `[...] =`"}

#: aten ops torch has no public function or method of that name for (or one layers do not
#: call: ``F.pad`` records ``constant_pad_nd``), as the user writes them.
_WRITTEN = {"slice": "indexing `[...]`", "index": "indexing `[...]`",
            "index_put": "an assignment `[...] =`", "index_put_": "an assignment `[...] =`",
            "_to_copy": "`Tensor.to`", "_unsafe_view": "`Tensor.view`",
            "sym_size": "`Tensor.size`", "sym_numel": "`Tensor.numel`",
            "constant_pad_nd": "`F.pad`", "native_layer_norm": "`F.layer_norm`",
            "native_group_norm": "`F.group_norm`"}


def torch_name(node: torch.fx.Node) -> str:
    """The op ``node`` runs, as the torch call a user writes: "`torch.mul`" for
    ``aten.mul.Tensor``, "`Tensor.view`" for ``aten.view.default``, "`F.silu`" for
    ``aten.silu.default``, "indexing `[...]`" for a slice; the graph's inputs, attributes and
    submodules by their names."""
    if node.op == "placeholder":
        return f"the input `{node.target}`"
    if node.op == "get_attr":
        return f"the attribute `{node.target}`"
    if node.op == "call_module":
        return f"the submodule `{node.target}`"
    if node.op == "call_method":
        return f"`Tensor.{node.target}`"
    if node.op != "call_function":
        return "the output"
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
    if packet is None and getattr(target, "__module__", None) in ("_operator", "operator"):
        return _OPERATORS.get(name, f"`operator.{name}`")
    if name in _WRITTEN:
        return _WRITTEN[name]
    if not name.startswith("_") and hasattr(torch, name):
        return f"`torch.{name}`"
    if not name.startswith("_") and hasattr(torch.Tensor, name):
        return f"`Tensor.{name}`"
    if not name.startswith("_") and hasattr(torch.nn.functional, name):
        return f"`F.{name}`"
    namespace = getattr(target, "namespace", None)
    return f"`torch.ops.{namespace}.{name}`" if namespace else f"`{name}`"


def describe_op(node: torch.fx.Node) -> str:
    """How a refusal names an op of the user's layer: the torch call and the line that made it,
    "`torch.mul` at lact.py:88 (`y = x * 2`)"; an op no line of the layer made (torch's or
    ttt2la's own code made it while tracing) says so instead of pointing at a line."""
    src = node_src(node)
    what = torch_name(node)
    if src is not None:
        return f"{what} at {src.at()}"
    if node.op != "call_function":
        return what
    return (f"{what} (made by torch's or ttt2la's own code while tracing, not by a line of "
            "the layer)")


def op_at(node: torch.fx.Node) -> str:
    """``describe_op`` without the line's code, for notes and tables where a short form reads
    better: "`torch.mul` at lact.py:88", or the torch call alone where no line made it."""
    src = node_src(node)
    what = torch_name(node)
    return f"{what} at {src.short_file}:{src.line}" if src is not None else what


__all__ = [
    "KIND", "NAME", "SRC", "PRODUCT_CHAIN", "PRODUCT_OPERAND", "SUMMED_PRODUCT", "LOOP_MODULE",
    "INPUT_FREE",
    "SourceLoc", "StateSpec", "StreamSpec", "InvariantSpec",
    "OutputSpec", "TTTProgram", "node_src", "describe_op", "op_at", "torch_name",
    "copy_graph", "placeholder", "graph_module", "lazy_graph_modules",
    "memory_order", "inverse_order", "with_memory_order", "ancestors", "descendants", "loop_interface",
    "bind_loop_args", "params_and_buffers", "ShapeTemplate", "SizeReader", "layout_free",
    "reshape_views",
]
