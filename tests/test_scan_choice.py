"""Scalar-affine states (momentum, a decay gate: ``S' = a ⊙ S + f``) scanned over the chunks or
run as a loop over them, as the cost rule decides per call: either path equals the hand-written
loop (outputs, final states, every gradient), whether the state is the last group (its outputs read
inside the loop) or feeds a later one; the report names the path that ran; the rule as it stands.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ttt2la
from equivalence import assert_same_function
from test_executors import assert_matches_recurrent, assert_matches_reference, make_program
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import lower, scan_choice
from ttt2la.lowering.scan_choice import affine_scan_pays, scanning
from ttt2la.zoo import GatedChunkMemory

shapes = st.fixed_dictionaries(dict(
    B=st.sampled_from([1, 2]), d=st.sampled_from([2, 3]), C=st.sampled_from([1, 2, 3]),
    inclusive=st.booleans(), last_chunk=st.sampled_from(["update", "apply_only"]),
    n_len=st.integers(min_value=1, max_value=9), seed=st.integers(0, 3)))


@pytest.mark.parametrize("kind", ["momentum_muon", "gated_per_token"])
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "looped"])
@settings(max_examples=6, deadline=None)
@given(shapes)
def test_either_path_equals_the_hand_written_loop(kind, scan, s):
    """Momentum feeds the weights' prefix sum (not the last group); the per-token gate's state
    is the last group, read inside its loop when looped."""
    C = 1 if kind == "gated_per_token" else s["C"]
    program = make_program(kind, s["B"], s["d"], C, s["inclusive"], s["last_chunk"])
    with scanning(scan):
        assert_matches_reference(kind, program, s["n_len"], s["seed"], C=C,
                                 inclusive=s["inclusive"], last_chunk=s["last_chunk"])


@pytest.mark.parametrize("last_chunk", ["update", "apply_only"])
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "looped"])
def test_a_gated_state_read_before_and_after_its_update_either_way(scan, last_chunk):
    """Outputs reading the gated state before and after each chunk's update, and a later
    state summing it: equal to the recurrent loop on both paths."""
    def body(S, T, k, v, g, q):
        S_next = torch.sigmoid(g).mean(-2, keepdim=True).transpose(-1, -2) * S \
            + k.transpose(-1, -2) @ v
        return (S_next, T + S_next), (q @ S + q @ S_next + q @ T,)
    B, d, C, L = 2, 3, 2, 10                # whole chunks: the gate's mean reads every token
    program = program_from_body(
        body, states=dict(S=torch.randn(B, d, d), T=torch.randn(B, d, d)),
        streams=dict(k=torch.randn(B, L, d), v=torch.randn(B, L, d), g=torch.randn(B, L, d),
                     q=torch.randn(B, L, d)), chunk_size=C, last_chunk=last_chunk)
    with scanning(scan):
        analysis, _ = assert_matches_recurrent(program, L)
    assert "affine" in analysis.group_modes


def test_the_plan_names_the_path_that_ran():
    program = make_program("momentum_muon", 1, 2, 2, False, "update")
    plan = lower(program, None)
    states0 = [torch.zeros(s.shape) for s in program.states]
    invariants = [torch.randn(spec.shape) for spec in program.invariants]
    for scan in (False, True):
        with scanning(scan):
            plan(states0, invariants)
        momentum = [program.states[t].name for group, mode in
                    zip(plan.analysis.groups, plan.analysis.group_modes) if mode == "affine"
                    for t in group]
        assert momentum and all((f"sequential: {m}" in plan.implementation) != scan
                                for m in momentum), plan.implementation


def test_the_rule_scans_small_states_and_loops_large_ones(monkeypatch):
    """Fitted on the grid of ``benchmarks/gated_memories.py``: 4 heads × 8 at batch 4 (1,024
    elements) scanned faster, 4 heads × 16 (4,096) looped faster; always the scan under a
    compiler; ``scanning`` forces either path."""
    assert affine_scan_pays(torch.zeros(4, 4, 8, 8))
    assert not affine_scan_pays(torch.zeros(4, 4, 16, 16))
    assert not affine_scan_pays(torch.zeros(4, 4, 64, 64))
    with scanning(True):
        assert affine_scan_pays(torch.zeros(4, 4, 64, 64))
    with scanning(False):
        assert not affine_scan_pays(torch.zeros(4, 4, 8, 8))
    monkeypatch.setattr(scan_choice.torch.compiler, "is_compiling", lambda: True)
    assert affine_scan_pays(torch.zeros(4, 4, 64, 64))


def test_a_gated_memory_with_a_large_state_loops_and_is_exact():
    """The zoo's gated memory, 2 heads × 64 at batch 2 (16,384 elements): lifted onto the block
    op, which on a CPU pays only for smaller states, so looped by the rule, named so in the
    report, equal to the layer as written."""
    torch.manual_seed(0)
    layer = GatedChunkMemory(128, 2, 8)
    x = torch.randn(2, 64, 128)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert_same_function(converted, layer, [x])
    assert "sequential: W" in converted.ttt2la_report.layers[0].runs["batch 2"]
