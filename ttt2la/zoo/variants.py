"""The paper's simplification ladder as constructor switches: variant k is LaCT with steps 1..k.

Each step turns one feature of LaCT off (Section 6.1, Table 2); a model built as variant k is
one *trained* that way, which converts exactly at level k.
"""
from __future__ import annotations

#: The switch each step turns off, in the paper's order.
STEPS = (
    ("update_theta", "update only the final layer W (freeze Θ)"),
    ("weight_norm", "remove weight normalisation"),
    ("mlp", "multi-layer MLP → single linear layer (φ = identity)"),
    ("per_token_lr", "per-token learning rate → constant"),
    ("momentum", "remove momentum"),
    ("muon", "remove Muon"),
)


def variant_switches(variant: int) -> dict[str, bool]:
    """The constructor switches of LaCT variant ``variant`` (0: LaCT as published, 6: linear
    attention): every step up to ``variant`` turned off, the others on."""
    if isinstance(variant, bool) or not isinstance(variant, int) or not 0 <= variant <= len(STEPS):
        raise ValueError(f"variant must be an integer from 0 to {len(STEPS)}, got {variant!r}")
    return {name: i >= variant for i, (name, _) in enumerate(STEPS)}


def with_variant(variant: int | None, kw: dict) -> dict:
    """``kw`` with the switches of ``variant`` added; a switch given in ``kw`` as well must agree."""
    if variant is None:
        return dict(kw)
    switches = variant_switches(variant)
    clash = sorted(k for k, v in switches.items() if k in kw and kw[k] != v)
    if clash:
        raise ValueError(f"variant {variant} sets {', '.join(f'{k}={switches[k]}' for k in clash)}; "
                         "drop the conflicting keyword or the variant")
    return {**kw, **switches}


__all__ = ["STEPS", "variant_switches", "with_variant"]
