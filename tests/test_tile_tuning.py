"""Tile tuning's choice: the fastest candidate that runs, once per shape class, and the default unless asked.

The device timer is replaced by a table of times, so these tests run anywhere Triton imports; what each
candidate computes is tested against the references in ``test_triton_kernels.py``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from triton_interpreter import import_kernels  # noqa: E402

import_kernels()    # before anything of ttt2la.runtime.triton: the first import decides for the process

from triton.runtime.errors import OutOfResources  # noqa: E402

from ttt2la.runtime.triton import tile_tuning  # noqa: E402
from ttt2la.runtime.triton.tile_tuning import Config, candidates, choose, config, sides_up_to  # noqa: E402


@pytest.fixture
def device(monkeypatch):
    """Tuning on, as on a GPU, with a fake timer: ``times[config]`` ms (a ``BaseException`` entry is raised
    as if the candidate failed to compile); records which configurations were timed."""
    monkeypatch.setattr(tile_tuning, "INTERPRET", False)
    monkeypatch.setattr(tile_tuning, "CHOSEN", {})
    monkeypatch.setattr(tile_tuning, "_forced", {})
    tile_tuning.tune_kernels(True)
    state = {"times": {}, "timed": []}

    def fake_time(run):
        run()
        c = state["timed"][-1]
        t = state["times"][c]
        if isinstance(t, BaseException):
            raise t
        return t

    monkeypatch.setattr(tile_tuning, "_time", fake_time)
    yield state
    tile_tuning.tune_kernels(None)


def _options():
    default = config(8, 2, BK=64, BV=64)
    return candidates(default, {"BK": (32, 64), "BV": (32, 64)}, warps=(4, 8), stages=(2,))


def test_candidates_start_with_the_default_and_repeat_nothing():
    options = _options()
    assert options[0] == config(8, 2, BK=64, BV=64)
    assert len(options) == len(set(options)) == 8      # 2 × 2 tile sides × 2 warp counts, stages fixed
    assert {c["BK"] for c in options} == {32, 64} and {c.num_warps for c in options} == {4, 8}


def test_sides_up_to_drops_tiles_wider_than_the_dimension_needs():
    assert sides_up_to(20, (32, 64, 128)) == (32,)
    assert sides_up_to(40, (32, 64, 128)) == (32, 64)
    assert sides_up_to(72, (32, 64, 128)) == (32, 64, 128)
    assert sides_up_to(1, (16, 32)) == (16,)


def test_tuning_picks_the_fastest_candidate_once_per_shape_class(device):
    options = _options()
    device["times"] = {c: 1.0 + i for i, c in enumerate(options)}
    fastest = options[5]
    device["times"][fastest] = 0.5
    run = device["timed"].append
    assert choose("site", ("key", 1), options, run) == fastest
    assert device["timed"] == options                 # every candidate timed, in order
    assert choose("site", ("key", 1), options, run) == fastest
    assert len(device["timed"]) == len(options)       # the second launch reuses the choice
    device["times"][options[2]] = 0.1
    assert choose("site", ("key", 2), options, run) == options[2]      # another shape class is tuned anew
    assert choose("other site", ("key", 1), options, run) == options[2]
    tuned = tile_tuning.CHOSEN[("site", ("key", 1))]
    assert tuned.chosen == fastest and tuned.times[fastest] == 0.5


def test_a_candidate_that_does_not_compile_is_skipped(device):
    options = _options()
    device["times"] = {c: 2.0 for c in options}
    device["times"][options[1]] = OutOfResources(300000, 232448, "shared memory")
    device["times"][options[3]] = 1.0
    assert choose("site", (), options, device["timed"].append) == options[3]
    assert tile_tuning.CHOSEN[("site", ())].times[options[1]] is None


def test_when_nothing_compiles_the_default_is_launched_to_raise_its_own_error(device):
    options = _options()
    device["times"] = {c: OutOfResources(1, 0, "registers") for c in options}
    assert choose("site", (), options, device["timed"].append) == options[0]


def test_other_errors_are_not_mistaken_for_a_candidate_that_cannot_run(device):
    options = _options()
    device["times"] = {c: 1.0 for c in options}
    device["times"][options[1]] = ValueError("a bug in the launch")
    with pytest.raises(ValueError, match="a bug"):
        choose("site", (), options, device["timed"].append)


def test_without_tuning_the_default_runs_and_nothing_is_timed(device, monkeypatch):
    options = _options()
    tile_tuning.tune_kernels(False)
    assert choose("site", (), options, device["timed"].append) == options[0]
    tile_tuning.tune_kernels(None)
    monkeypatch.delenv(tile_tuning.ENV, raising=False)
    assert choose("site", (), options, device["timed"].append) == options[0]
    monkeypatch.setenv(tile_tuning.ENV, "1")
    device["times"] = {c: 1.0 for c in options}
    device["times"][options[4]] = 0.2
    assert choose("site", (), options, device["timed"].append) == options[4]


def test_the_interpreter_never_tunes(device, monkeypatch):
    monkeypatch.setattr(tile_tuning, "INTERPRET", True)
    options = _options()
    assert choose("site", (), options, device["timed"].append) == options[0]
    assert device["timed"] == []
    assert options[0].options == {}


def test_a_forced_configuration_wins_and_is_restored(device):
    options = _options()
    device["times"] = {c: 1.0 for c in options}
    forced = Config((("BK", 32), ("BV", 32)), 4, 3)
    with tile_tuning.forcing(site=forced):
        assert choose("site", (), options, device["timed"].append) == forced
    assert device["timed"] == []
    assert choose("site", (), options, device["timed"].append) == options[0]   # all equal: the first


def test_launch_options_of_a_configuration(monkeypatch):
    c = config(8, 3, BT=64, BX=128)
    assert c["BX"] == 128 and str(c) == "BT=64 BX=128, 8 warps, 3 stages"
    monkeypatch.setattr(tile_tuning, "INTERPRET", False)
    assert c.options == {"num_warps": 8, "num_stages": 3}


def test_the_device_timer_runs_the_launch_and_takes_the_median(monkeypatch):
    """``_time`` hands Triton's benchmarker the launch itself and asks for the median (the benchmarker
    needs a GPU, so a stand-in records what it was given)."""
    import functools

    import triton.testing

    seen = {}

    def benchmarker(fn, **options):
        fn()
        seen.update(options)
        return 1.25

    monkeypatch.setattr(triton.testing, "do_bench", benchmarker)
    ran = []
    launch = functools.partial(ran.append, config(4, 2, BK=32))
    assert tile_tuning._time(launch) == 1.25
    assert ran == [config(4, 2, BK=32)] and seen.get("return_mode") == "median"


@pytest.mark.parametrize("dtype, decay_grad, settled", [("bfloat16", True, True), ("bfloat16", False, False),
                                                        ("float32", True, False)])
def test_settled_defaults_launch_where_timing_settled_them(monkeypatch, dtype, decay_grad, settled):
    """The chunk op's backward launches its timed half-precision defaults with the decay's gradient, and the
    defaults derived from the tile caps everywhere else (fp32, or no decay gradient)."""
    import torch

    from ttt2la.runtime import triton as kernels
    from ttt2la.runtime.triton import chunk

    defaults = {}
    real_launch = chunk.launch

    def recording_launch(site, key, options, run):
        defaults[site] = options[0]
        return real_launch(site, key, options, run)

    monkeypatch.setattr(chunk, "launch", recording_launch)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(1, 20, 1, 64, dtype=dt, requires_grad=True) for _ in range(3))
    log_decay = (-torch.rand(1, 20, 1)).requires_grad_(decay_grad)
    kernels.chunk_linear_attention(q, k, v, log_decay=log_decay, scale=0.125)[0].float().sum().backward()
    for site, timed in chunk.SETTLED_HALF_BACKWARD.items():
        assert (defaults[site] == timed) == settled, (site, defaults[site])
    assert defaults["chunk.states"] == chunk.feature_configs(64, 64, dt)[0]   # the forward keeps its defaults
