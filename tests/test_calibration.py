"""Calibration data at the loop, drift of every lossy step from one run of the passes, and the sweep."""
from __future__ import annotations

import json

import pytest
import torch

import ttt2la
from ttt2la.analysis import assign_roles
from ttt2la.calibration import LoopCalibration
from ttt2la.conversion import recognize
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import TinyLaCTLM, lact_layer

D, H, C = 16, 2, 8


def small_layer(seed=0):
    torch.manual_seed(seed)
    return lact_layer("folded", d_model=D, num_heads=H, chunk_size=C, muon=False)


@pytest.fixture(scope="module")
def layer():
    return small_layer()


@pytest.fixture(scope="module")
def example():
    return (torch.randn(2, 4 * C, D, generator=torch.Generator().manual_seed(1)),)


@pytest.fixture(scope="module")
def calibration():
    return (torch.randn(5, 3 * C + 3, D, generator=torch.Generator().manual_seed(2)),)


def recognized(layer, example):
    (rl,), _inputs, _notes = recognize(layer, example)
    program = rl.program.clone()
    assign_roles(program)
    return rl, program


def test_capture_records_the_loop_inputs_in_pieces_of_the_traced_batch(layer, example,
                                                                          calibration):
    rl, program = recognized(layer, example)
    cal = LoopCalibration.capture(rl, calibration, {})
    rows = rl.B0 * rl.layout.batch_unit
    assert len(cal.samples) == -(-5 // rows)
    k_spec = program.invariants[next(s for s in program.streams if s.role == "k").source]
    for sample in cal.samples:
        k = sample[k_spec.name]
        assert k.shape[0] == k_spec.shape[0]             # the traced batch
        assert (3 * C + 3) in k.shape                    # the calibration length


def test_chunk_values_follow_the_loop(layer, example, calibration):
    """Stream values per chunk are the calibration keys cut into chunks, in order."""
    rl, program = recognized(layer, example)
    cal = LoopCalibration.capture(rl, calibration, {})
    k_stream = next(i for i, s in enumerate(program.streams) if s.role == "k")
    node = program.stream_inputs()[k_stream]
    (values,) = cal.chunk_values(program, [node])
    spec = program.streams[k_stream]
    full = (3 * C + 3) // C
    assert len(values) == full * len(cal.samples)
    source = cal.samples[0][program.invariants[spec.source].name]
    for j in range(full):
        expect = source.narrow(spec.axis, j * C, C)
        assert torch.equal(values[j], expect)


def test_lossy_levels_calibrate_a_bf16_layer_whose_chunks_are_laid_out_otherwise():
    """ViTTT in bf16 keeps views its fp32 trace copies first; the calibration runs the loop body
    on chunk slices laid out otherwise, and must read them (it raised 'view size is not
    compatible'). The bf16 conversion is as close to the fp32 one as bf16 is to fp32."""
    from ttt2la.zoo import ViTTTBlock

    torch.manual_seed(0)
    block = ViTTTBlock(8, 2, 4, 4)
    x = torch.randn(2, 16, 8)
    fp32 = ttt2la.convert(block, level=6, example_inputs=(x,))
    bf16 = ttt2la.convert(block.bfloat16(), level=6, example_inputs=(x.bfloat16(),))
    y = torch.randn(3, 16, 8)
    assert rel_rms_error(bf16(y.bfloat16()), fp32(y)) <= 2e-2


def test_calibration_drift_is_measured_on_the_calibration_inputs(layer, example, calibration):
    converted = ttt2la.convert(layer, level=2, example_inputs=example, calibration=calibration)
    (report,) = converted.ttt2la_report.layers
    drifts = {p.step: p.drift for p in report.passes}
    assert set(drifts) == {1, 2}
    assert all(d["inputs"] == "calibration" for d in drifts.values())
    # the last step's drift is the converted layer's own error on the calibration inputs
    with torch.no_grad():
        final = rel_rms_error(converted(*calibration), layer(*calibration))
    assert drifts[2]["rel_rms_error"] == pytest.approx(final, rel=1e-4)
    # step 1's drift, from the same run of the passes, is what converting at level 1 gives
    level1 = ttt2la.convert(layer, level=1, example_inputs=example, calibration=calibration)
    with torch.no_grad():
        alone = rel_rms_error(level1(*calibration), layer(*calibration))
    assert drifts[1]["rel_rms_error"] == pytest.approx(alone, rel=1e-4)
    assert drifts[1]["rel_rms_error"] > 0


def test_without_calibration_the_example_inputs_are_named(layer, example):
    converted = ttt2la.convert(layer, level=1, example_inputs=example)
    (p,) = [p for p in converted.ttt2la_report.layers[0].passes if p.drift]
    assert p.drift["inputs"] == "example"


def test_a_calibration_the_model_rejects_is_a_conversion_error(layer, example):
    with pytest.raises(ttt2la.ConversionError, match="calibration inputs"):
        ttt2la.convert(layer, level=1, example_inputs=example,
                       calibration=(torch.randn(2, 3 * C, D + 1),))


def test_language_model_loss_change_is_reported():
    torch.manual_seed(0)
    model = TinyLaCTLM(40, D, 1, H, C, muon=False)
    ids = torch.randint(0, 40, (2, 4 * C), generator=torch.Generator().manual_seed(3))
    converted = ttt2la.convert(model, level=2, example_inputs=(ids,), calibration=(ids,))
    loss = converted.ttt2la_report.loss
    with torch.no_grad():
        ce = lambda m: torch.nn.functional.cross_entropy(  # noqa: E731
            m(ids)[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1)).item()
        assert loss["original"] == pytest.approx(ce(model), rel=1e-5)
        assert loss["converted"] == pytest.approx(ce(converted), rel=1e-5)
    assert loss["change"] == pytest.approx(loss["converted"] - loss["original"])
    passes = converted.ttt2la_report.layers[0].passes
    assert all("loss_change" in p.drift for p in passes if p.drift)
    assert f"loss {loss['change']:+.3g} nats" in converted.ttt2la_report.summary


def test_sweep_tabulates_every_level(layer, example, calibration, tmp_path):
    report = ttt2la.sweep(layer, calibration, example_inputs=example, levels=[0, 1, 2],
                          time_budget=2.0)
    rows = {r.label: r for r in report.rows}
    assert list(rows) == ["original", "level 0", "level 1", "level 2"]
    assert rows["level 0"].exact and rows["level 0"].drift == 0.0
    assert not rows["level 2"].exact and rows["level 2"].drift > 0
    assert rows["level 2"].runtime.startswith("block_linear_attention")
    assert all(r.tokens_per_s and r.tokens_per_s > 0 for r in report.rows)
    assert report.inputs == "calibration"
    md = report.to_markdown()
    assert "| level 2 | no |" in md and "TTT tokens/s" in md
    data = json.loads(report.to_json())
    assert [r["level"] for r in data["rows"]] == [None, 0, 1, 2]
    png = tmp_path / "sweep.png"
    report.plot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_refuses_levels_outside_the_ladder(layer, example):
    with pytest.raises(ValueError, match="0 to 6"):
        ttt2la.sweep(layer, example_inputs=example, levels=[7])


def test_sweep_command_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    from ttt2la.cli import main

    path, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["sweep", "--zoo", "per-token", "--length", "16", "--levels", "0", "2",
                 "--format", "markdown", "--max-seconds", "1", "--json", str(path),
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| level 0 | yes |" in out and "| level 2 | yes |" in out
    assert [r["level"] for r in json.loads(path.read_text())["rows"]] == [None, 0, 2]
    assert png.exists()


def test_sweep_shows_each_fold_by_what_it_scales():
    """A fold of one number per stream shows its value; a matrix (collapse_mlp's record) shows
    the pass alone, not the record's field names."""
    from ttt2la.sweep import _folded

    assert _folded("absorb_lr", {"lr": 0.853455, "lr_2": 2}) == "absorb_lr: lr=0.8535, lr_2=2"
    assert _folded("collapse_mlp", {"M": [[1.0, 0.5]], "groups": 1,
                                    "identity_residual": False}) == "collapse_mlp"
