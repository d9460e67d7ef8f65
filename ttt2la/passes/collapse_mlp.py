"""Step 3 of the paper: the fast-weight MLP becomes a single linear layer, ``φ(x) = x·M``.

After steps 1–2 a LaCT layer reads ``o = φ(q)·W`` and updates ``W`` by ``φ(k)ᵀ(ηv)`` with
``φ(x) = silu(x W0ᵀ) ⊙ (x W2ᵀ)`` and Θ = (W0, W2) frozen. This pass rewrites every place the
kernel features are computed — the query path and the key path — as one fixed linear map of the
(normalised) keys and queries, so the layer is linear attention with keys ``kM`` and queries
``qM`` and a ``d_h × d_v`` state; Θ then feeds nothing and dies.

The map is written where the kernel has a linear branch: the matmul ``x·Θ₂`` (the *product*)
keeps its place and layout, with ``Θ₂`` replaced by ``M`` (a constant of the body), and the
kernel's value is that product, relaid out as the kernel's own views did. Fold: ``M`` is the
least-squares map (float64) that best reproduces φ on the calibration keys and queries, one per
head — the rows of a batch axis that folds heads in share ``M`` when they share Θ. Unfolded,
``M`` is the identity (truncated or zero-padded when ``d_k ≠ d_h``). Not exact: a model trained
with an MLP computes something else through one linear layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..analysis.dependence import node_shape, op_name
from ..analysis.op_vocabulary import (ACTIVATIONS, ADDITIVE, CASTS, KNOWN_NONLINEAR,
                                     MATRIX_PRODUCTS, SCALINGS, SLICES)
from ..analysis.roles import VIEW_OPS, final_products, kernel_parameters, peel_views
from ..errors import ConversionError, UnsupportedTTTError
from ..ir import INPUT_FREE, NAME, SRC, TTTProgram, ancestors, describe_op, descendants, op_at
from .base import Pass, PassContext, PassResult, register, remove_dead_states

MAP_ATTR = "collapse_mlp_map"        # the body attribute holding M in Θ's layout
#: Linear ops of stream data for ``nonlinear_ops``: views, slices, additions and scalings,
#: matrix products, selections and concatenations — narrower than the vocabulary's linear maps
#: (no masked fills, scatters or reductions), which this pass does not track.
_LINEAR_OPS = VIEW_OPS | SLICES | ADDITIVE | SCALINGS | MATRIX_PRODUCTS \
    | frozenset({"select", "cat", "stack"})



#: What to do where collapse_mlp cannot rewrite φ: a lower level keeps φ as written (an MLP, a
#: normalised projection).
_LOWER = ("convert at level 2 or below, which keeps φ as written (a layer that is not "
          "reducible there converts with strict=False, on the recurrent schedule).")

def _replayed(n: torch.fx.Node) -> bool:
    """A view replayed from the product to the kernel's value: its other arguments are
    constants (sizes, dims, dtypes) or sizes the body computes (a body generic in the length),
    so it applies to any value of the product's shape."""
    return op_name(n) in VIEW_OPS and all(
        isinstance(a.meta.get("val"), (int, torch.SymInt)) for a in _operands(n))


def _operands(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes among ``n``'s arguments other than its first, in lists included."""
    return _flat_nodes((*n.args[1:], *n.kwargs.values()))


@dataclass
class Site:
    """One place the kernel features are computed: ``core = views(elementwise(product, ...))``."""

    core: torch.fx.Node          # φ's value (views to the final product peeled)
    product: torch.fx.Node       # the matmul of the stream side with Θ that stays, with M
    stream: torch.fx.Node        # the product's operand read from the keys or queries
    path: list[torch.fx.Node]    # core, ..., product: the shape-preserving chain between them


@dataclass
class Kernel:
    """The kernel φ of a program: where it is computed and which operand of its product is Θ."""

    sites: list[Site]            # the query path's first, then the key path's
    theta_pos: int               # 0: product = Θ·x, 1: product = x·Θ
    theta: list[torch.fx.Node]   # the placeholders φ reads besides the keys and queries
    aliases: list = None         # (query-path Θ, key-path Θ) read as different placeholders



# -- finding the kernel ----------------------------------------------------------------------

def streamed_nodes(program: TTTProgram) -> set[torch.fx.Node]:
    """Nodes computed from the chunk streams (keys, queries, values ...)."""
    inv = program.invariant_inputs()
    seeds = set(program.stream_inputs()) | {inv[s.source] for s in program.streams}
    return descendants(program.body.graph, seeds)


def nonlinear_ops(core: torch.fx.Node, streamed: set, order: dict) -> list[torch.fx.Node]:
    """The ops between the streams and ``core`` that are not linear in the stream data (a shift
    counts: ``φ(x) = xA + b`` is affine, not a map the keys and queries can absorb)."""
    found = []
    for n in sorted(ancestors(core) & streamed, key=order.__getitem__):
        if n.op != "call_function":
            continue
        name = op_name(n)
        fed = [a for a in n.all_input_nodes if a in streamed]
        operands = [a for a in n.args[:2]]
        if name not in _LINEAR_OPS:
            found.append(n)
        elif name in ("mul", "bmm", "mm", "matmul") and len(fed) > 1:
            found.append(n)
        elif name == "div" and (n.args[0] not in streamed or len(fed) > 1):
            found.append(n)
        elif name in ("add", "sub", "rsub") and not all(a in streamed for a in operands):
            found.append(n)
    return found


def _path(core, product) -> list[torch.fx.Node] | None:
    """``[core, ..., product]`` through replayable views and shape-preserving ops, or None."""
    if core is product:
        return [core]
    if not isinstance(core, torch.fx.Node) or core.op != "call_function" \
            or op_name(core) in MATRIX_PRODUCTS or product not in ancestors(core):
        return None
    if _replayed(core):
        rest = _path(core.args[0], product)
        return None if rest is None else [core, *rest]
    for a in core.args:
        if isinstance(a, torch.fx.Node) and node_shape(a) is not None \
                and node_shape(a) == node_shape(core):
            rest = _path(a, product)
            if rest is not None:
                return [core, *rest]
    return None


def _product(core, theta_dep: set, streamed: set, order: dict):
    """The product to keep in ``core``'s cone, ``(node, Θ position, path)``, or None: a matmul
    of Θ with stream data that reaches ``core`` through shape-preserving ops, the one with the
    fewest nonlinear ops on the way (SwiGLU's ``x W2ᵀ`` branch)."""
    found = []
    for n in ancestors(core):
        if n.op != "call_function" or op_name(n) not in MATRIX_PRODUCTS:
            continue
        for pos in (0, 1):
            t, x = n.args[pos], n.args[1 - pos]
            if t in theta_dep and t not in streamed and x in streamed and x not in theta_dep:
                path = _path(core, n)
                if path is not None:
                    bends = sum(op_name(p) in KNOWN_NONLINEAR for p in path[1:])
                    found.append(((bends, order[n]), n, pos, path))
    if not found:
        return None
    _key, n, pos, path = min(found, key=lambda f: f[0])
    return n, pos, path


def _signature(n, theta: set, theta_dep: set, memo: dict):
    """The computation of ``n`` from Θ, with every Θ-free value a hole and every Θ placeholder
    known by its shape: two places compute the same kernel when their signatures are equal and
    their Θ placeholders hold the same values (a Θ hoisted out of the loop is one placeholder per
    place it is read; ``CollapseMLP`` compares them on calibration data)."""
    if not isinstance(n, torch.fx.Node):
        if isinstance(n, (list, tuple)):
            return tuple(_signature(a, theta, theta_dep, memo) for a in n)
        return repr(n)
    if n not in memo:
        if n in theta:
            memo[n] = ("Θ", node_shape(n))
        elif n not in theta_dep:
            memo[n] = "·"
        else:
            memo[n] = (n.op, str(n.target), _signature(list(n.args), theta, theta_dep, memo),
                       tuple(sorted((k, _signature(v, theta, theta_dep, memo))
                                    for k, v in n.kwargs.items())))
    return memo[n]


def _follow(core: torch.fx.Node, like: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The chain in ``core``'s cone at the argument positions ``like`` takes from its core."""
    chain = [core]
    for parent, child in zip(like, like[1:]):
        chain.append(chain[-1].args[list(parent.args).index(child)])
    return chain


def find_kernel(program: TTTProgram) -> tuple[Kernel | None, str]:
    """The kernel φ and every place it is computed, or ``None`` and why there is nothing to do
    (the reason starts with the status: ``not_applicable`` or ``already_satisfied``)."""
    finals = final_products(program)
    if not finals:
        return None, "not_applicable: no final product φ·W on an output path"
    order = {n: i for i, n in enumerate(program.body.graph.nodes)}
    streamed = streamed_nodes(program)
    theta = kernel_parameters(program)
    params = kernel_candidates(program)
    theta_dep = descendants(program.body.graph, params)
    cores = list(dict.fromkeys(peel_views(f.phi) for f in finals))
    states = set(program.state_inputs())
    bends = [n for c in cores for n in nonlinear_ops(c, streamed, order)]
    stated = [n for c in cores for n in ancestors(c) if n in states]
    if not bends and not stated:
        if not theta:
            return None, "already_satisfied: φ is the identity on the keys and queries"
        return None, (f"already_satisfied: φ is a fixed linear map ({len(theta)} parameter "
                      "tensor(s), no state), which folds into the projections exactly")
    found = _product(cores[0], theta_dep, streamed, order)
    if found is None:
        what = op_at(bends[0]) if bends else "a state"
        if not theta:
            return None, (f"not_applicable: φ has no parameters Θ to collapse (a fixed feature "
                          f"map, {what})")
        raise UnsupportedTTTError(
            f"the kernel φ of {program.module_path or 'the model'} ({program.loop_src}) has no "
            f"product of the keys or queries with its parameters Θ that reaches its value "
            f"through elementwise ops ({describe_op(cores[0])}), so collapse_mlp cannot write "
            f"it as one linear layer; {_LOWER}")
    product, pos, path = found
    memo: dict = {}
    want = _signature(cores[0], params, theta_dep, memo)
    sites, leaves = [], []
    for n in program.body.graph.nodes:
        if n in streamed and n in theta_dep and _signature(n, params, theta_dep, memo) == want:
            chain = path if n is cores[0] else _follow(n, path)
            sites.append(Site(n, chain[-1], chain[-1].args[1 - pos], chain))
    sites.sort(key=lambda s: (s.core not in cores, order[s.core]))
    leaves = [_leaves(s.core, params, theta_dep) for s in sites]
    theta = list(dict.fromkeys(n for site_leaves in leaves for n in site_leaves))
    _require_key_path(program, cores, sites, theta)
    aliases = [(a, b) for site_leaves in leaves[1:] for a, b in zip(leaves[0], site_leaves)
               if a is not b]
    return Kernel(sites, pos, theta, aliases), ""


def _require_key_path(program: TTTProgram, cores: list, sites: list[Site], theta: list) -> None:
    """φ computed on the queries only, with Θ read nowhere else in the body: the increment reads
    keys' features computed before the loop or step, which the rewrite cannot reach."""
    read_side = {a for c in cores for a in ancestors(c)} | set(cores)
    if any(s.core not in cores for s in sites) or any(
            u.op != "output" and u not in read_side for t in theta for u in t.users):
        return
    raise UnsupportedTTTError(
        f"the kernel φ of {program.module_path or 'the model'} ({program.loop_src}) is "
        f"computed on the query path ({describe_op(cores[0])}) but on no key path: the "
        "state's increment reads keys' features computed before the "
        f"{'step' if program.single_step else 'loop'}, outside the code ttt2la rewrites, so "
        "collapse_mlp cannot make φ one linear map on both; compute φ(k) where the state is "
        f"updated, or {_LOWER}")


def kernel_candidates(program: TTTProgram) -> set[torch.fx.Node]:
    """Placeholders φ may read as Θ: frozen kernel states and invariants other than the
    sequences the streams are sliced from (a loop-invariant view of Θ hoisted out of the loop
    is its own invariant, once per place it is read) and constants the code makes from numbers
    alone (``INPUT_FREE``: the identity a UT transform's triangular solve reads is no weight)."""
    inv = program.invariant_inputs()
    sources = {inv[s.source] for s in program.streams}
    ins = program.state_inputs()
    thetas = {ins[i] for i in program.states_with_role("theta")}
    return {n for n in inv if n not in sources and INPUT_FREE not in n.meta} | thetas


def _leaves(core: torch.fx.Node, params: set, theta_dep: set) -> list[torch.fx.Node]:
    """The Θ placeholders ``core`` reads, in argument order (the same order at every site)."""
    out, stack = [], [core]
    while stack:
        n = stack.pop()
        if n in params:
            out.append(n)
        elif n in theta_dep:
            stack.extend(reversed([a for a in _flat_nodes(n.args)]))
    return out


def _flat_nodes(args) -> list[torch.fx.Node]:
    found = []
    for a in args:
        if isinstance(a, torch.fx.Node):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(_flat_nodes(a))
    return found


# -- the fold --------------------------------------------------------------------------------

def _as_rows(x: torch.Tensor, theta_pos: int) -> torch.Tensor:
    """A product operand or result as ``[rows, tokens, features]`` (the ``x·M`` convention)."""
    x = x.reshape(-1, *x.shape[-2:])
    return x.transpose(-1, -2) if theta_pos == 0 else x


def _period(thetas: list[torch.Tensor]) -> int:
    """The fewest leading rows whose Θ every row repeats (heads folded into the batch by
    ``repeat``: rows ``r`` and ``r + H`` share Θ); 1 when every row has its own."""
    rows = thetas[0].shape[0]
    for p in range(1, rows + 1):
        if rows % p == 0 and all(torch.equal(t.reshape(rows // p, p, *t.shape[1:]),
                                             t[:p].expand(rows // p, p, *t.shape[1:]))
                                 for t in thetas):
            return p if p < rows or rows == 1 else 1
    return 1


def _replay_operands(site: Site) -> list[torch.fx.Node]:
    """The sizes the views between a site's product and its kernel value take from the body."""
    return [a for n in site.path[:-1] if _replayed(n) for a in _operands(n)]


def _in_product_layout(site: Site, core_value: torch.Tensor, product_shape,
                       sizes: dict) -> torch.Tensor:
    """The kernel's value laid out like the product it is rewritten from (the inverse of the
    views between them, found by running those views on the product's element indices);
    ``sizes``: the values of ``_replay_operands`` at this chunk."""
    index = torch.arange(int(torch.Size(product_shape).numel())).reshape(product_shape)
    for n in reversed(site.path[:-1]):
        if _replayed(n) and op_name(n) not in CASTS:
            args = torch.fx.node.map_arg(n.args[1:], sizes.__getitem__)
            kwargs = torch.fx.node.map_arg({k: v for k, v in n.kwargs.items()
                                            if k != "memory_format"}, sizes.__getitem__)
            index = n.target(index, *args, **kwargs)
    out = torch.full((index.numel(),), float("nan"), dtype=torch.float64)
    flat = index.reshape(-1)
    out[flat] = core_value.reshape(-1).to(torch.float64)
    if torch.isnan(out).any():
        raise UnsupportedTTTError(f"the kernel φ ({describe_op(site.core)}) does not cover its "
                                  "linear branch's values, so collapse_mlp cannot fit it")
    return out.reshape(product_shape)


def fit_map(program: TTTProgram, kernel: Kernel, calibration) -> tuple[torch.Tensor, dict]:
    """The least-squares ``M`` ([groups, d_k, d_h], float64) with ``x·M ≈ φ(x)`` on the keys and
    queries of every calibration chunk, one per group of rows sharing Θ, and how well it fits."""
    theta_node = kernel.sites[0].product.args[kernel.theta_pos]
    # each node once: a size the views of several sites take is recorded once
    nodes = list(dict.fromkeys([theta_node, *(n for s in kernel.sites for n in
                                              (s.stream, s.core, s.product, *_replay_operands(s)))]))
    per_chunk = dict(zip(nodes, calibration.chunk_values(program, nodes)))
    if not per_chunk[theta_node]:
        raise ConversionError(
            f"the calibration data gives no full chunk of {program.module_path or 'the model'} "
            f"(chunk size {program.chunk_size}) to fit collapse_mlp's map on; pass longer "
            "calibration sequences")
    thetas = [_as_rows(t, 1).double() for t in per_chunk[theta_node]]
    groups = _period(thetas)
    xs, ys = [[] for _ in range(groups)], [[] for _ in range(groups)]
    for site in kernel.sites:
        operands = _replay_operands(site)
        for j, (x, y, product) in enumerate(zip(per_chunk[site.stream], per_chunk[site.core],
                                                per_chunk[site.product])):
            x = _as_rows(x.double().cpu(), kernel.theta_pos)
            sizes = {a: per_chunk[a][j] for a in operands}
            y = _as_rows(_in_product_layout(site, y.cpu(), product.shape, sizes),
                         kernel.theta_pos)
            for g in range(groups):
                xs[g].append(x[g::groups].reshape(-1, x.shape[-1]))
                ys[g].append(y[g::groups].reshape(-1, y.shape[-1]))
    X = [torch.cat(x) for x in xs]
    Y = [torch.cat(y) for y in ys]
    M = torch.stack([torch.linalg.lstsq(x, y, driver="gelsd").solution for x, y in zip(X, Y)])
    eye = torch.eye(M.shape[1], M.shape[2], dtype=torch.float64).expand_as(M)
    stats = {"groups": groups, "tokens": int(sum(x.shape[0] for x in X)),
             "residual": _residual(X, Y, M), "identity_residual": _residual(X, Y, eye)}
    return M, stats


def _residual(X, Y, M) -> float:
    """Relative RMS error of ``x·M`` against φ over all fitted tokens."""
    err = sum(float(((x @ m - y) ** 2).sum()) for x, y, m in zip(X, Y, M))
    ref = sum(float((y ** 2).sum()) for y in Y)
    return (err / ref) ** 0.5 if ref > 0 else 0.0


# -- the rewrite -----------------------------------------------------------------------------

def _meta_val(target, args, kwargs):
    """The output of ``target`` on meta tensors shaped like ``args`` (for node metadata)."""
    def meta(a: torch.fx.Node):
        v = a.meta["val"]
        if not isinstance(v, torch.Tensor):
            return v                            # a size the body computes, at the traced shape
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return target(*torch.fx.node.map_arg(tuple(args), meta),
                  **torch.fx.node.map_arg(dict(kwargs), meta))


def _call(graph: torch.fx.Graph, target, args, kwargs=None, src=None) -> torch.fx.Node:
    node = graph.call_function(target, tuple(args), dict(kwargs or {}))
    node.meta["val"] = _meta_val(target, args, kwargs or {})
    if src is not None:
        node.meta[SRC] = src
    return node


def _map_node(program: TTTProgram, kernel: Kernel, M: torch.Tensor) -> torch.fx.Node:
    """The body constant standing where Θ stood in the product: ``M`` in Θ's layout, its groups
    tiled over the rows (``repeat``, so it is generic in the batch size)."""
    theta_node = kernel.sites[0].product.args[kernel.theta_pos]
    shape, dtype = node_shape(theta_node), theta_node.meta["val"].dtype
    rows = 1
    for d in shape[:-2]:
        rows *= d
    groups = M.shape[0]
    if rows % groups:
        raise ConversionError(
            f"collapse_mlp's folded map has {groups} groups of rows (heads), which do not tile the "
            f"{rows} rows of Θ ({describe_op(theta_node)}); replay it on a batch of a "
            "multiple of the heads, or convert again from calibration data")
    device = theta_node.meta["val"].device
    # kept in float64 and cast in the body, so a float64 evaluation of the body is exact
    value = (M.transpose(-1, -2) if kernel.theta_pos == 0 else M).to(torch.float64)
    program.body.register_buffer(MAP_ATTR, value.to(device).contiguous())
    graph = program.body.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        node = graph.get_attr(MAP_ATTR)
        node.meta["val"] = torch.empty(value.shape, dtype=torch.float64, device="meta")
        node = _call(graph, torch.ops.aten._to_copy.default, (node,), {"dtype": dtype})
        if len(shape) == 2:
            return _call(graph, torch.ops.aten.view.default, (node, list(shape)))
        tiled = _call(graph, torch.ops.aten.repeat.default, (node, [rows // groups, 1, 1]))
        return _call(graph, torch.ops.aten.view.default, (tiled, list(shape)))


def rewrite(program: TTTProgram, kernel: Kernel, M: torch.Tensor) -> None:
    """Replace every site's kernel value by its product with ``M`` in Θ's place, relaid out by
    the site's own views; the nonlinear branches become dead code."""
    mapped = _map_node(program, kernel, M)
    graph = program.body.graph
    for site in kernel.sites:
        src = site.core.meta.get(SRC)
        with graph.inserting_before(site.core):
            args = list(site.product.args)
            args[kernel.theta_pos] = mapped
            new = _call(graph, site.product.target, args, site.product.kwargs, src)
            for n in reversed(site.path[:-1]):
                if _replayed(n):
                    new = _call(graph, n.target, (new, *n.args[1:]), n.kwargs, src)
        site.core.replace_all_uses_with(new)
    program.recompile()


def _identity_map(kernel: Kernel) -> torch.Tensor:
    """The unfolded map: ``[1, d_k, d_h]`` ones on the diagonal (truncation or zero padding)."""
    theta = node_shape(kernel.sites[0].product.args[kernel.theta_pos])
    d_in, d_out = (theta[-2], theta[-1]) if kernel.theta_pos == 1 else (theta[-1], theta[-2])
    return torch.eye(d_in, d_out, dtype=torch.float64).unsqueeze(0)


def _where(kernel: Kernel) -> str:
    q = op_at(kernel.sites[0].core)
    keys = len(kernel.sites) - 1
    return f"φ ({q}" + (f", and {keys} more place(s) on the key path)" if keys else ")")


def _describe_map(M: torch.Tensor, folded: dict | None, source: str) -> str:
    groups, d_k, d_h = M.shape
    if folded is None:
        shape = "the identity" if d_k == d_h else \
            f"the identity {d_k}→{d_h} (truncation or zero padding)"
        return f"M {shape} ({source})"
    per = f"one per head ({groups})" if groups > 1 else "shared by all rows"
    return (f"M the least-squares map {d_k}×{d_h} {per}, {source} (fit residual "
            f"{folded['residual']:.3g}; identity {folded['identity_residual']:.3g})")


class CollapseMLP(Pass):
    """Write the kernel φ as one fixed linear map of the keys and queries (the paper's Step 3)."""

    name = "collapse_mlp"
    step = 3
    exact = False          # φ no longer blocks associativity once Θ is frozen: no blocker

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Fit (or replay) ``M``, put it in every place φ is computed, drop the Θ that dies."""
        kernel, why = find_kernel(program)
        if kernel is None:
            status, reason = why.split(": ", 1)
            return self.result(status, reason)
        self._require_one_theta(program, kernel, context)
        folded, M, source = self._map(program, kernel, context)
        theta_names = [n.meta.get(NAME, n.name) for n in kernel.theta]
        rewrite(program, kernel, M)
        removed = remove_dead_states(program)
        self._require_theta_dead(program, kernel)
        self._require_no_mlp_left(program, kernel)
        reason = (f"{_where(kernel)} became x·M, {_describe_map(M, folded, source)}; Θ "
                  f"({', '.join(theta_names)}) no longer read")
        if removed:
            reason += f", state(s) {', '.join(removed)} removed"
        program.notes.append(f"collapse_mlp: {reason}")
        return self.result("applied", reason, folded)

    def _map(self, program: TTTProgram, kernel: Kernel, context: PassContext):
        """``(folded constants or None, M, how)``: replayed, fitted from calibration, or the
        identity (unfolded, or no calibration data to fit on)."""
        if not context.fold:
            return None, _identity_map(kernel), "unfolded"
        recorded = context.replay(self.name)
        if recorded is not None:
            return recorded, torch.tensor(recorded["M"], dtype=torch.float64), "replayed"
        if context.calibration is None:
            return None, _identity_map(kernel), "no calibration data, nothing folded"
        M, stats = fit_map(program, kernel, context.calibration)
        folded = {"shape": list(M.shape), **stats, "M": M.tolist()}
        context.folds[self.name] = folded
        return folded, M, "fitted"

    def _require_theta_dead(self, program: TTTProgram, kernel: Kernel) -> None:
        """Θ must feed nothing once φ is linear; a reader left means φ is computed elsewhere in a
        form the rewrite did not recognise."""
        for node in kernel.theta:
            users = [u for u in node.users if u.op != "output"]
            if users:
                where, name = describe_op(users[0]), node.meta.get(NAME, node.name)
                raise UnsupportedTTTError(
                    f"collapse_mlp rewrote {_where(kernel)} in {program.module_path or 'the model'}"
                    f" ({program.loop_src}), but the kernel parameter {name} is still read by "
                    f"{where}: φ is computed there in a form that does not match the query path. "
                    f"{_LOWER[0].upper()}{_LOWER[1:]}")

    def _require_one_theta(self, program: TTTProgram, kernel: Kernel, context: PassContext) -> None:
        """The key path's Θ, read as other placeholders than the query path's, must hold the same
        values on the calibration data: the same kernel, hoisted once per place it is read."""
        if not kernel.aliases or context.calibration is None:
            return
        for sample in context.calibration.samples:
            for a, b in kernel.aliases:
                va, vb = sample.get(a.meta.get(NAME)), sample.get(b.meta.get(NAME))
                if va is None or vb is None:
                    continue
                if va.shape != vb.shape or not torch.equal(va, vb):
                    raise UnsupportedTTTError(
                        f"the kernel φ of {program.module_path or 'the model'} "
                        f"({program.loop_src}) reads {a.meta.get(NAME)} on the query path where "
                        f"the key path reads {b.meta.get(NAME)} with other values: the keys and "
                        "queries go through different networks, which is not a TTT kernel "
                        f"collapse_mlp can write as one map; {_LOWER}")

    def _require_no_mlp_left(self, program: TTTProgram, kernel: Kernel) -> None:
        """No activation of a product of stream data with Θ may remain: that would be a kernel
        the rewrite did not recognise, still running beside the collapsed one."""
        params = kernel_candidates(program)
        theta_dep, streamed = descendants(program.body.graph, params), streamed_nodes(program)
        for n in program.body.graph.nodes:
            if n.op == "call_function" and op_name(n) in ACTIVATIONS and n in theta_dep \
                    and n in streamed:
                raise UnsupportedTTTError(
                    f"collapse_mlp rewrote {_where(kernel)} in {program.module_path or 'the model'}"
                    f" ({program.loop_src}), but {describe_op(n)} still applies an activation "
                    "to the keys or queries times kernel parameters: φ is computed there in a "
                    f"form that does not match the query path. {_LOWER[0].upper()}{_LOWER[1:]}")

    def ensures(self, program: TTTProgram) -> None:
        """Every kernel φ left that reads kernel parameters Θ is a fixed linear map of the keys
        and queries, and no φ reads a state. A φ of the streams alone (keys weighted by the
        decay left to their chunk's end, as chunked gated linear attention writes them) is no
        MLP of Θ: this step has nothing to collapse there."""
        order = {n: i for i, n in enumerate(program.body.graph.nodes)}
        streamed = streamed_nodes(program)
        states = set(program.state_inputs())
        params = kernel_candidates(program)
        for f in final_products(program):
            core = peel_views(f.phi)
            reads = ancestors(core)
            if (params & reads and nonlinear_ops(core, streamed, order)) or states & reads:
                raise AssertionError(
                    f"collapse_mlp left a nonlinear kernel ({describe_op(core)})")


collapse_mlp = register(CollapseMLP())

__all__ = ["CollapseMLP", "collapse_mlp", "find_kernel", "fit_map", "rewrite", "Kernel", "Site",
           "MAP_ATTR"]
