"""CPU timings of recurrences written as flash-linear-attention's reference loops
(``ttt2la.zoo.FlaReferenceLayer``), converted, against the layer as written and the same
recurrence written by hand with matmuls, side by side.

    python benchmarks/fla_reference.py [--quick] [--rounds N] [--threads N] [--backward]
                                       [--only NAME] [--value-decay]

Retention (a decay per head), a scalar gate per head and token, a gate per key channel (GLA),
a gate per value channel (a column of the state, fla's ``gv``), the gated delta rule, Mamba-2's recurrence as its minimal reference steps it (state value-first,
read by a sum over its last axis), linear attention with its normaliser (a second memory, run as
value columns of the first), RWKV-6's time mixing (a decay per key channel, the state read before
each write plus the token's own product weighted by a bonus), the chunk forms of the gated
references (``zoo.FlaChunkReferenceLayer``: in-chunk attention written out, the state decayed once
per chunk, per head, per key channel or per value channel; no hand-written row, the layer is that
form), and a
per-token TTT layer that reads its fast weight before each token writes it
(``zoo.PerTokenTTTLayer(read="before")``, its ``torch.compile``d step run eagerly); 4 heads,
256 features, B = 2, L = 1024 (``--quick``: 256). Rows run interleaved in one process
(``ttt2la.timing``): medians, spread, ratios as medians of per-round ratios against the layer
as written, every converted row with the plan that ran and its error against the layer as
written. ``--value-decay``: the layers decayed per value channel only, as written, on the generic
plan (converted with the lift switched off, as before the ops took that decay) and lifted
(``value_decay`` / ``value_log_decay``, the op forced), a forward and a training step each.
"""
from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

import ttt2la
from fused_styles import print_table
from matrix_affine_memories import _gradient_error, _TrainingStep, arguments
from ttt2la.lowering import plan as plan_module
from ttt2la.lowering.scan_choice import scanning
from ttt2la.testing import rel_rms_error
from ttt2la.timing import time_side_by_side
from ttt2la.zoo import FlaChunkReferenceLayer, PerTokenTTTLayer
from ttt2la.zoo.fla_chunk_reference import CHUNK_RULES
from ttt2la.zoo.fla_reference import RULES, FlaReferenceLayer

DIM, HEADS, BATCH = 256, 4, 2


def by_hand(layer: FlaReferenceLayer, x):
    """The layer's recurrence as a token loop of batched matmuls (``q_t S``, ``k_tᵀ v_t``)."""
    B, T, _ = x.shape
    H = layer.num_heads
    if layer.rule == "ssd":
        return ssd_by_hand(layer, x)
    if layer.rule == "normalised":
        return normalised_by_hand(layer, x)
    if layer.rule == "rwkv6":
        return rwkv6_by_hand(layer, x)
    q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in layer.qkv(x).chunk(3, -1))
    q = q * q.shape[-1] ** -0.5
    K = q.shape[-1]
    if layer.rule == "retention":
        decay = (1 - 2 ** (-5.0 - torch.arange(H, dtype=x.dtype)))[None, :, None, None, None]
        decay = decay.expand(B, H, T, 1, 1)
    elif layer.rule == "scalar_gate":
        decay = F.logsigmoid(layer.gate(x) + 4).transpose(1, 2).exp()[..., None, None]
    elif layer.rule == "vector_gate":
        g = F.logsigmoid(layer.gate(x) + 4).view(B, T, H, K).transpose(1, 2) / 16
        decay = g.exp()[..., None]
    elif layer.rule == "value_gate":
        g = F.logsigmoid(layer.gate(x) + 4).view(B, T, H, -1).transpose(1, 2) / 16
        decay = g.exp()[..., None, :]
    else:
        b, a = layer.gate(x).transpose(1, 2).chunk(2, 1)
        beta, decay = torch.sigmoid(b), F.logsigmoid(a + 3).exp()[..., None, None]
        k = F.normalize(k, dim=-1)
    S = x.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        kt, vt = k[:, :, t, :, None], v[:, :, t, None, :]
        S = decay[:, :, t] * S
        if layer.rule == "gated_delta":
            vt = (vt - kt.mT @ S) * beta[:, :, t, None, None]
        S = S + kt @ vt
        outs.append(q[:, :, t, None, :] @ S)
    o = torch.cat(outs, 2)
    return layer.out(o.transpose(1, 2).reshape(B, T, -1))


def normalised_by_hand(layer: FlaReferenceLayer, x):
    """Normalised linear attention with matmuls: ``q S / (q z + ε)``."""
    B, T, _ = x.shape
    q, k, v = (t.view(B, T, layer.num_heads, -1).transpose(1, 2)
               for t in layer.qkv(x).chunk(3, -1))
    q, k = F.elu(q * q.shape[-1] ** -0.5) + 1, F.elu(k) + 1
    S, z, outs = x.new_zeros(B, layer.num_heads, k.shape[-1], v.shape[-1]), 0, []
    for t in range(T):
        S = S + k[:, :, t, :, None] @ v[:, :, t, None, :]
        z = z + k[:, :, t, :, None]
        qt = q[:, :, t, None, :]
        outs.append(qt @ S / (qt @ z + 1e-6))
    o = torch.cat(outs, 2)
    return layer.out(o.transpose(1, 2).reshape(B, T, -1))


def rwkv6_by_hand(layer: FlaReferenceLayer, x):
    """RWKV-6's time mixing with matmuls: ``o_t = r_t S + ((r_t ⊙ u)·k_t) v_t``, then the write."""
    B, T, _ = x.shape
    H = layer.num_heads
    r, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in layer.qkv(x).chunk(3, -1))
    r = r * r.shape[-1] ** -0.5
    decay = torch.exp(-torch.exp(layer.gate(x).view(B, T, H, -1).transpose(1, 2) - 4))
    own = ((r * layer.bonus[None, :, None]) * k).sum(-1, keepdim=True) * v
    S, outs = x.new_zeros(B, H, k.shape[-1], v.shape[-1]), []
    for t in range(T):
        outs.append(r[:, :, t, None, :] @ S + own[:, :, t, None])
        S = decay[:, :, t, :, None] * S + k[:, :, t, :, None] @ v[:, :, t, None, :]
    o = torch.cat(outs, 2)
    return layer.out(o.transpose(1, 2).reshape(B, T, -1))


def ssd_by_hand(layer: FlaReferenceLayer, x):
    """Mamba-2's recurrence with matmuls: ``h ← e^{ΔA} h + (Δx)ᵀ B``, ``y = h Cᵀ``."""
    B, T, _ = x.shape
    C, Bk, xs = (t.view(B, T, layer.num_heads, -1) for t in layer.qkv(x).chunk(3, -1))
    dt, A = F.softplus(layer.gate(x)), -torch.exp(layer.A_log)
    h = x.new_zeros(B, layer.num_heads, xs.shape[-1], Bk.shape[-1])
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h \
            + (dt[:, t, :, None] * xs[:, t]).unsqueeze(-1) @ Bk[:, t].unsqueeze(-2)
        ys.append((h @ C[:, t].unsqueeze(-1))[..., 0])
    return layer.out(torch.stack(ys, 1).reshape(B, T, -1))


def read_first_by_hand(layer: PerTokenTTTLayer, x):
    """``PerTokenTTTLayer(read="before")`` as one loop: read ``W``, then write the token."""
    B, L, _ = x.shape
    q, k, v = layer.qkv(x).view(B, L, 3, layer.num_heads, layer.head_dim).unbind(dim=2)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    eta = F.softplus(layer.lr_proj(x) + layer.base_lr_inv)
    W, outs = layer.w0.unsqueeze(0).expand(B, -1, -1, -1), []
    for t in range(L):
        outs.append((q[:, t, :, None, :] @ W)[:, :, 0])
        W = W + eta[:, t, :, None, None] * (k[:, t, :, :, None] @ v[:, t, :, None, :])
    return layer.o_proj(torch.stack(outs, 1).reshape(B, L, -1))


def cases(quick: bool, dim: int = DIM, heads: int = HEADS, batch: int = BATCH,
          length: int | None = None):
    """(name, layer, hand-written function, input) of every case: each reference recurrence,
    then a per-token TTT layer that reads its fast weight before each token writes it."""
    g = torch.Generator().manual_seed(0)
    length = length or (256 if quick else 1024)
    for rule in RULES:
        torch.manual_seed(0)
        yield (f"{rule}, {heads} heads x {dim // heads}, L={length}",
               FlaReferenceLayer(dim, heads, rule), by_hand,
               torch.randn(batch, length, dim, generator=g))
    # the gate per key channel made stronger by its bias: about e^-0.4 per token (chunks of 64
    # split into sub-chunks, each factored) and e^-1.6 (sub-chunks exact per channel)
    for strength, bias in (("medium", -10.0), ("strong", -30.0)):
        torch.manual_seed(0)
        layer = FlaReferenceLayer(dim, heads, "vector_gate")
        with torch.no_grad():
            layer.gate.bias.add_(bias)
        yield (f"vector_gate, {strength} decay, {heads} heads x {dim // heads}, L={length}",
               layer, by_hand, torch.randn(batch, length, dim, generator=g))
    # RWKV-6 with its decays spread as its initialisation spreads them: from e^-0.0025 to
    # e^-0.37 per token across each head's channels (chunks of 64 split into sub-chunks of 16)
    torch.manual_seed(0)
    layer = FlaReferenceLayer(dim, heads, "rwkv6")
    with torch.no_grad():
        layer.gate.bias.copy_(torch.linspace(-2.0, 3.0, dim // heads).repeat(heads))
    yield (f"rwkv6, decays spread as initialised, {heads} heads x {dim // heads}, L={length}",
           layer, by_hand, torch.randn(batch, length, dim, generator=g))
    # the chunk form of the references: in-chunk attention built by the layer, the state decayed
    # once per chunk (the block op with its decay), chunks of 64 (shorter for short sequences);
    # the layer is its own
    # hand-written form
    for rule in CHUNK_RULES:
        torch.manual_seed(0)
        yield (f"{rule}, chunk form, {heads} heads x {dim // heads}, L={length}",
               FlaChunkReferenceLayer(dim, heads, rule, min(64, length // 4)), None,
               torch.randn(batch, length, dim, generator=g))
    torch.manual_seed(0)
    yield (f"per-token TTT read before write, {heads} heads x {dim // heads}, L={length}",
           PerTokenTTTLayer(dim, heads, read="before"), read_first_by_hand,
           torch.randn(batch, length, dim, generator=g))


class _Plan:
    """A converted layer called with its op forced (``op``: the scan chosen, not a loop over
    chunks) or its cost rule deciding, never raced against the code as written; with
    ``train``, one training step (``_TrainingStep``)."""

    def __init__(self, layer, op: bool | None, train: bool):
        self.layer, self.op = layer, op
        self.step = _TrainingStep(layer) if train else None

    def __call__(self, x):
        with scanning(self.op), ttt2la.race_as_written(False):
            return self.layer(x) if self.step is None else self.step(x)

    def grads(self) -> dict:
        return self.step.grads()


def value_decay_table(length: int, rounds: int, dim: int = DIM, heads: int = HEADS,
                      batch: int = BATCH) -> None:
    """The layers decayed per value channel: as written, the generic plan, the lifted op; a
    forward under no_grad and a training step, rows interleaved (``ttt2la.timing``)."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print("| case | pass | row | ms (median) | spread | vs as written | plan (error) |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, layer in ((f"value_gate, per token, {heads} heads x {dim // heads}, L={length}",
                         FlaReferenceLayer(dim, heads, "value_gate")),
                        (f"gla_value, chunk form, {heads} heads x {dim // heads}, L={length}",
                         FlaChunkReferenceLayer(dim, heads, "gla_value", min(64, length // 4)))):
        x = torch.randn(batch, length, dim, generator=g)
        lifted = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        with mock.patch.object(plan_module, "lift", lambda program: None):
            generic = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        for train in (False, True):
            written = _TrainingStep(layer) if train else (lambda t, m=layer: m(t))
            rows = {"as written": written, "generic plan": _Plan(generic, None, train),
                    "lifted": _Plan(lifted, True, train)}
            timings = time_side_by_side(rows, (x,), rounds=rounds, max_seconds=60.0,
                                        no_grad=not train, warmup=2)
            for row, timing in timings.items():
                error = ""
                if row != "as written":
                    err = _gradient_error(rows, row, x) if train else _no_grad_error(rows, row, x)
                    model = generic if row == "generic plan" else lifted
                    ran = model.ttt2la_report.layers[0].runs.get(f"batch {batch}", "?")
                    error = f"{ran} ({err:.1e})"
                ratio = timing.speedup_over(timings["as written"]) if row != "as written" else ""
                print(f"| {name} | {'training step' if train else 'forward'} | {row} | "
                      f"{timing.median * 1e3:.1f} | {timing.spread()} | {ratio} | {error} |",
                      flush=True)


def _no_grad_error(rows, row, x) -> float:
    with torch.no_grad():
        return rel_rms_error(rows[row](x), rows["as written"](x))


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", metavar="TEXT",
                        help="only the cases whose name starts with TEXT (e.g. rwkv6)")
    parser.add_argument("--value-decay", action="store_true",
                        help="the layers decayed per value channel: as written, generic, lifted")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.compiler.set_stance("force_eager")      # the per-token step as written, eagerly
    if args.value_decay:
        value_decay_table(256 if args.quick else 1024, args.rounds)
        return
    chosen = [c for c in cases(args.quick) if c[0].startswith(args.only)]
    print_table(chosen, args.rounds, args.backward)


if __name__ == "__main__":
    main()
