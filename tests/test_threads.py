"""A converted layer called from several threads at once computes what it computes from one.

The interleavings that went wrong are forced deterministically: a plain call made on another
thread while a call carrying state is inside the layer, and while the layer's first stateful
call probes whether its code can carry state. Forward-mode derivatives, which some plans take
at run time, are checked under real contention.

References: the original layer as written, float32 ≤ 1e-5.
"""
from __future__ import annotations

import threading

import pytest
import torch

import ttt2la
import ttt2la.converted
import ttt2la.locality
from ttt2la.lowering.forward_ad import jvp
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import DeltaMemoryLayer, LaCTHeadsLayer, PerTokenTTTLayer

FP32 = TOLERANCE[torch.float32]
D = 8


def _x(B: int, L: int, seed: int) -> torch.Tensor:
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed))


def _on_another_thread(fn):
    """``fn()`` run on a new thread, joined: its result, or the error it raised."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:          # handed back to the test
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _converted(make):
    torch.manual_seed(0)
    layer = make()
    return layer, ttt2la.convert(layer, level=2, example_inputs=(_x(2, 16, 0),))


LAYERS = {"per-token": lambda: PerTokenTTTLayer(D, 2),
          "delta rule": lambda: DeltaMemoryLayer(D, 2)}


@pytest.mark.parametrize("name", LAYERS)
def test_a_plain_call_while_another_thread_carries_state(name, monkeypatch):
    """A plain call on another thread, made while a stateful call carrying a state from an
    earlier piece runs, starts from the layer's own state, and leaves the stateful call's."""
    layer, converted = _converted(LAYERS[name])
    first, x, other = _x(2, 16, 1), _x(2, 16, 2), _x(2, 16, 3)
    seen, started = [], []
    planned = ttt2la.converted.stateful_plan

    def plan_and_interleave(loop):
        if not started:     # once, inside the stateful call, with its state registered
            started.append(True)
            with torch.no_grad():
                seen.append(_on_another_thread(lambda: converted(other)))
        return planned(loop)

    with torch.no_grad():
        _, carried = converted(first, return_ttt_state=True)
        monkeypatch.setattr(ttt2la.converted, "stateful_plan", plan_and_interleave)
        y, state = converted(x, ttt_state=carried, return_ttt_state=True)
        assert rel_rms_error(seen[0], layer(other)) <= FP32
        whole = layer(torch.cat([first, x, other], 1))
        assert rel_rms_error(y, whole[:, 16:32]) <= FP32
        # the state it hands on is its own, not the other thread's
        assert rel_rms_error(converted(other, ttt_state=state), whole[:, 32:]) <= FP32


def test_a_plain_call_while_another_thread_probes_for_streaming(monkeypatch):
    layer, converted = _converted(LAYERS["per-token"])
    other = _x(2, 5, 2)                 # the probe's first shape: 2 chunks (of one token) + 3
    with torch.no_grad():
        converted(other)                # the plain call's graphs exist before the probe
    seen, stands = [], []
    stand = ttt2la.locality._Stand

    class Interleaved(stand):
        def forward(self, *args):
            stands.append(True)
            # once, in the probe's third run: its stand replies with the first run's outputs,
            # which a plain call sharing its graph would return for its own input
            if len(stands) == 3:
                with torch.no_grad():
                    seen.append(_on_another_thread(lambda: converted(other)))
            return super().forward(*args)

    monkeypatch.setattr(ttt2la.locality, "_Stand", Interleaved)
    with torch.no_grad():
        y, _state = converted(_x(2, 7, 1), return_ttt_state=True)   # the probe runs here
        assert rel_rms_error(seen[0], layer(other)) <= FP32
        assert rel_rms_error(y, layer(_x(2, 7, 1))) <= FP32
    assert converted._ttt2la.for_weights(converted, dict(converted.named_parameters())) \
        .streamable == ""


def test_forward_mode_derivatives_from_several_threads():
    """``torch.func.jvp`` keeps its dual level process-wide; ``forward_ad.jvp`` serialises."""
    errors = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(40):
            x = torch.randn(16, 16, generator=g)
            try:
                _, tangent = jvp(lambda a: (a @ a).sin(), (x,), (torch.ones_like(x),))
                want = (torch.ones_like(x) @ x + x @ torch.ones_like(x)) * (x @ x).cos()
                assert rel_rms_error(tangent, want) <= FP32
            except Exception as e:      # collected: the test fails on any
                errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_a_plan_taking_forward_mode_derivatives_runs_on_several_threads():
    """A plan whose momentum runs as a scan takes each chunk's factor by forward-mode
    differentiation at run time (``executors._affine_terms``): from four threads at once, each
    call gives what it gives alone."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_executors import inputs_for, make_program
    from ttt2la.lowering import execute

    program = make_program("momentum_muon", 2, 3, 4, True, "update")
    inputs = [inputs_for(program, 24, seed) for seed in range(4)]
    with torch.no_grad():
        alone = [execute(program, None, *x)[0][0] for x in inputs]
    got = {}

    def work(i):
        with torch.no_grad():
            for _ in range(25):
                try:
                    y = execute(program, None, *inputs[i])[0][0]
                    got.setdefault(i, []).append(rel_rms_error(y, alone[i]))
                except Exception as e:  # collected: the test fails on any
                    got.setdefault(i, []).append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for rs in got.values() for r in rs if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert max(r for rs in got.values() for r in rs) <= FP32


def test_stateful_calls_taking_forward_mode_derivatives_on_several_threads():
    torch.manual_seed(0)
    layer = LaCTHeadsLayer(D, 2, 4, muon=False, update_theta=False, weight_norm=False)
    converted = ttt2la.convert(layer, level=2, example_inputs=(_x(2, 16, 0),))
    results = {}

    def work(seed):
        x = _x(2, 16, seed)
        with torch.no_grad():
            for i in range(4):
                try:
                    y, state = converted(x[:, :8], return_ttt_state=True)
                    results[seed, i] = (torch.cat([y, converted(x[:, 8:], ttt_state=state)], 1),
                                        x)
                except Exception as e:  # collected: the test fails on any
                    results[seed, i] = e

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results.values() if isinstance(r, Exception)]
    assert not errors, errors[:3]
    with torch.no_grad():
        for y, x in results.values():
            assert rel_rms_error(y, layer(x)) <= FP32
