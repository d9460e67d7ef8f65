"""The command line: argument parsing, refusals with their exit codes, reports from files, the demo."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ttt2la
from ttt2la import race_as_written
from ttt2la.cli import (EXIT_REFUSED, EXIT_UNSUPPORTED, ZOO, build_parser, build_zoo_model, main,
                        measure_throughput)
from ttt2la.report import ConversionReport, LayerReport, PassRecord, StateRecord

def saved_report(tmp_path, **changes) -> str:
    layer = LayerReport("blocks.0.ttt", "block_causal_lact_swiglu", "lact_folded.py:83", 64,
                        "exclusive", "apply_only",
                        [StateRecord("w1", "final", "W1' = W1 + phi(k)^T v", "additive")],
                        ["q", "k", "v"],
                        [PassRecord(1, "freeze_theta", "already_satisfied", True, "only w1 updated")],
                        "parallel", "torch", True, True)
    d = ConversionReport(level=2, layers=[layer], backend="torch", strict=True).to_dict()
    d.update(changes)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(d))
    return str(path)


# -- parsing -----------------------------------------------------------------------------------
def test_every_command_parses():
    parser = build_parser()
    assert parser.parse_args(["demo", "--quick"]).quick
    args = parser.parse_args(["convert", "--zoo", "lact-layer", "--level", "1", "--no-strict"])
    assert (args.zoo, args.level, args.strict, args.backend) == ("lact-layer", 1, False, "auto")
    assert parser.parse_args(["convert", "--zoo", "lact-layer"]).strict
    assert parser.parse_args(["inspect", "--zoo", "per-token", "--batch", "2"]).batch == 2
    assert parser.parse_args(["report", "r.json", "--markdown"]).markdown
    args = parser.parse_args(["bench", "--zoo", "lact-lm", "--levels", "0", "2"])
    assert (args.levels, args.strict, args.repeats) == ([0, 2], False, 15)
    assert parser.parse_args(["bench", "--zoo", "lact-lm", "--strict"]).strict


@pytest.mark.parametrize("argv", [
    [],                                               # no command
    ["transmogrify"],                                 # unknown command
    ["convert", "--zoo", "lact-layer", "--level", "7"],
    ["convert", "--zoo", "lact-layer", "--level", "two"],
    ["inspect", "--zoo", "no-such-model"],
    ["demo", "--length", "0"],
    ["report"],                                       # no file
    ["bench", "--zoo", "per-token", "--compile", "nope"],        # no such compiler backend
    ["bench", "--zoo", "per-token", "--compile-plan", "nope"],
])
def test_bad_command_lines_exit_with_status_2(argv, capsys):
    """A usage error is one line, as every other bad input is, naming the command and its help."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ttt2la") and "error:" in err
    assert "--help)" in err


def test_report_of_a_missing_path_or_a_plain_directory_is_bad_input(tmp_path, capsys):
    """A path that is not there, or a directory that is not a converted checkpoint: exit 2,
    one line saying which."""
    assert main(["report", str(tmp_path / "model.safetensors")]) == EXIT_UNSUPPORTED
    assert "model.safetensors: no such file or directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == EXIT_UNSUPPORTED
    assert "a directory without ttt2la.json" in capsys.readouterr().err


def test_report_of_a_weights_file_is_refused(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x80\x00\xff not text")
    assert main(["report", str(weights)]) == EXIT_REFUSED
    assert "is not JSON" in capsys.readouterr().err


def test_report_reads_a_report_under_any_file_name(tmp_path, capsys):
    """``convert --json`` takes any file name, so ``report`` reads any file holding a report."""
    path = tmp_path / "report.out"
    os.rename(saved_report(tmp_path), path)
    assert main(["report", str(path)]) == 0
    assert "converted exactly at level 2" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "convert", "bench"])
def test_a_model_must_be_named(command, capsys):
    assert main([command]) == EXIT_UNSUPPORTED
    assert "--zoo NAME" in capsys.readouterr().err


def test_module_entry_point_runs():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(ttt2la.__file__)))]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    done = subprocess.run([sys.executable, "-m", "ttt2la", "--version"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0
    assert done.stdout.strip() == f"ttt2la {ttt2la.__version__}"


def test_ctrl_c_while_the_command_imports_is_one_line():
    """Ctrl-C while ``python -m ttt2la`` still imports torch, before ``main`` runs: one line,
    exit status 2, no traceback (signalled as the package imports what follows the handler)."""
    import signal

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(ttt2la.__file__)))]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    # Launched as an interactive shell launches it: Ctrl-C not ignored, whatever this test
    # process inherited (a test runner's worker may ignore SIGINT, and children inherit that).
    child = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "ttt2la", "inspect",
                              "--zoo", "per-token"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    installed = False
    for line in child.stderr:           # an import done after the handler's module: installed
        if installed:
            break
        installed = line.rstrip().endswith("ttt2la.interrupt_at_launch")
    child.send_signal(signal.SIGINT)
    _out, err = child.communicate(timeout=120)
    assert child.returncode == EXIT_UNSUPPORTED, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].endswith("interrupted; nothing was written"), err


# -- report files --------------------------------------------------------------------------------
def test_report_renders_a_saved_report(tmp_path, capsys):
    path = saved_report(tmp_path)
    assert main(["report", path]) == 0
    out = capsys.readouterr().out
    assert "1 TTT layer converted exactly at level 2" in out
    assert "freeze_theta" in out

    assert main(["report", path, "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ttt2la conversion report")
    assert "| 1 | `freeze_theta` | already_satisfied | yes | only w1 updated |  |" in out


def test_report_refuses_unreadable_files(tmp_path, capsys):
    assert main(["report", saved_report(tmp_path, version=99)]) == EXIT_REFUSED
    assert "schema version 99" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["report", str(broken)]) == EXIT_REFUSED
    assert "is not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("changes, says", [
    ({"level": "two"}, "level is 'two', not int"), ({"strict": "yes"}, "strict is 'yes'"),
    ({"layers": None}, "layers is None"), ({"notes": 3}, "notes is 3")])
def test_report_refuses_fields_of_the_wrong_type(tmp_path, capsys, changes, says):
    """A report file is read, never trusted: a field of another type is a ``ReportFormatError``
    naming it, from the API and the command line (one line, no traceback)."""
    from ttt2la.report import ReportFormatError, load_report

    path = saved_report(tmp_path, **changes)
    with pytest.raises(ReportFormatError, match=says):
        load_report(json.loads(open(path).read()))
    assert main(["report", path]) == EXIT_REFUSED
    err = capsys.readouterr().err.strip()
    assert "ReportFormatError" in err and says in err and len(err.splitlines()) == 1, err


def test_report_refuses_a_binary_file(tmp_path, capsys):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x80\x02}q\x00X\x01\x00\x00\x00xq\x01.")
    assert main(["report", str(binary)]) == EXIT_REFUSED
    err = capsys.readouterr().err.strip()
    assert "binary.json is not JSON" in err and len(err.splitlines()) == 1, err


# -- zoo and timing ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_models_build_with_matching_inputs(name):
    model = build_zoo_model(name, seed=3)
    assert not model.training
    again = build_zoo_model(name, seed=3)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    (x,) = ZOO[name].example_inputs(batch=2, length=5, seed=1)
    assert x.shape[:2] == (2, 5)
    assert torch.equal(x, ZOO[name].example_inputs(batch=2, length=5, seed=1)[0])


@pytest.mark.parametrize("name", ["titans-linear", "gated-memory"])
def test_bench_times_a_memory_and_its_conversion(name, capsys):
    """``bench`` on a zoo memory: the Titans-like one returns its state beside its output (the
    drift column reads the output), the gated one loops over the chunks and races its plan
    against the code as written; each converted row is exact."""
    with race_as_written(True):
        assert main(["bench", "--zoo", name, "--length", "32", "--levels", "0", "--repeats", "3",
                     "--max-seconds", "1"]) == 0
    out = capsys.readouterr().out
    assert "level 0" in out and "0.00e+00" in out, out


@pytest.mark.parametrize("name", ["gla", "normalised-attention", "rwkv6"])
def test_bench_times_a_reference_recurrence_on_the_token_causal_op(name, capsys):
    """``bench`` on a recurrence written as flash-linear-attention's reference loop: the plan
    that ran is the token-causal op, its error within the fp32 bound."""
    assert main(["bench", "--zoo", name, "--length", "32", "--levels", "0", "--repeats", "3",
                 "--max-seconds", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "level 0" in line)
    assert "chunk_linear_attention" in row, out
    assert float(row.split("│")[-2]) <= 1e-5, row


def _plans(out: str) -> dict[str, str]:
    """Each row's "plan that ran" of a printed throughput table, by model, its cell joined where
    the table wrapped it onto the lines below (how wide it is depends on the timings printed)."""
    plans, model = {}, None
    for line in out.splitlines():
        cells = line.split("│")
        if len(cells) < 4:
            continue
        if cells[1].strip():
            model = cells[1].strip()
            plans[model] = cells[2].strip()
        elif model is not None:
            plans[model] += " " + cells[2].strip()
    return plans


def _bench_per_token(capsys, *options: str) -> str:
    """The table ``bench`` prints for the per-token zoo layer at level 0 (32 tokens, three
    rounds) with ``options``, TorchDynamo on."""
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        try:
            assert main(["bench", "--zoo", "per-token", "--length", "32", "--levels", "0",
                         "--repeats", "3", "--max-seconds", "1", *options]) == 0
        finally:
            torch._dynamo.reset()
    return capsys.readouterr().out


def _rows(out: str) -> dict[str, str]:
    """Each row's first line of a printed table, by model."""
    return {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}


def test_bench_compiled_rows_beside_the_eager_ones(capsys):
    """``bench --compile BACKEND`` times the original and each conversion compiled too, as rows
    of their own naming the plan and the compiler; a backend that fails on the models says so
    in its rows, and the eager rows are timed all the same (one torch.compile does not know is
    refused before any work)."""
    out = _bench_per_token(capsys, "--compile", "aot_eager")
    plans = _plans(out)
    assert "as written, under torch.compile" in plans["original, compiled"], out
    assert "chunk_linear_attention" in plans["level 0, compiled"], out
    assert "under torch.compile" in plans["level 0, compiled"], out
    assert float(_rows(out)["level 0, compiled"].split("│")[-2]) <= 1e-5, out
    from torch._dynamo import register_backend

    def refusing(gm, example_inputs):
        raise RuntimeError("this backend refuses every graph")
    register_backend(refusing, "ttt2la_cli_refusing_models")
    out = _bench_per_token(capsys, "--compile", "ttt2la_cli_refusing_models")
    rows = _rows(out)
    assert "not compiled: " in rows["original, compiled"] and "level 0" in rows, out


def test_bench_rows_of_conversions_made_with_compile(capsys):
    """``bench --compile-plan BACKEND`` times each level converted with ``compile=BACKEND`` as a
    row of its own, whose plan names the compiler; a backend failing on the plan says so in its
    row, and the other rows are timed all the same."""
    from torch._dynamo import register_backend

    def refusing(gm, example_inputs):
        raise RuntimeError("this backend refuses every graph")
    register_backend(refusing, "ttt2la_cli_refusing")
    out = _bench_per_token(capsys, "--compile-plan", "aot_eager")
    plans = _plans(out)
    assert "chunk_linear_attention" in plans["level 0, compile=aot_eager"], out
    assert "under torch.compile (aot_eager)" in plans["level 0, compile=aot_eager"], out
    assert "torch.compile" not in plans["level 0"], out
    assert float(_rows(out)["level 0, compile=aot_eager"].split("│")[-2]) <= 1e-5, out
    out = _bench_per_token(capsys, "--compile-plan", "ttt2la_cli_refusing")
    rows = _rows(out)
    assert "not compiled: " in rows["level 0, compile=ttt2la_cli_refusing"], out
    assert "level 0" in rows, out


@pytest.mark.parametrize("name", ["lact-lm", "lact-layer", "lact-variant2"])
def test_zoo_lact_models_run_on_their_inputs(name):
    model = build_zoo_model(name)
    inputs = ZOO[name].example_inputs(batch=1, length=2 * ZOO[name].chunk_size + 3)
    with torch.no_grad():
        y = model(*inputs)
    assert y.shape[:2] == inputs[0].shape[:2] and torch.isfinite(y).all()


def test_measure_throughput_times_every_model():
    calls = {"a": 0, "b": 0}

    def counting(name):
        def forward(x):
            calls[name] += 1
            return x
        return forward

    models = {"a": counting("a"), "b": counting("b")}
    rates = measure_throughput(models, (torch.zeros(1),), units=10, repeats=3, warmup=2)
    assert set(rates) == {"a", "b"} and all(r > 0 for r in rates.values())
    assert calls == {"a": 5, "b": 5}


# -- end to end ----------------------------------------------------------------------------------
def _table_rows(text: str) -> dict[str, list[str]]:
    """The first line of every row of a rich table, keyed by its first cell."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0]:
            rows[cells[0]] = cells[1:]
    return rows


def test_demo_quick_converts_the_trained_model_and_scores_every_level(capsys):
    from ttt2la.demo import CALIBRATION_SEQUENCES, implemented_levels
    from ttt2la.zoo.trained import next_token_loss, trained_char_lm, unigram_loss

    assert main(["demo", "--quick", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    levels = implemented_levels()
    assert {0, 1, 2} <= set(levels)
    assert out.count("ttt2la conversion report") == len(levels)
    table, summary = out.split("held-out loss and throughput")[-1].split("summary:")
    assert "on the same 4x128 bytes" in table
    rows = _table_rows(table)
    assert set(rows) == {"original"} | {f"level {k}" for k in levels}
    # the original's loss, recomputed here on the same held-out rows, beats a unigram model
    trained = trained_char_lm()
    held_out = trained.validation_sequences(4, 128)
    loss = next_token_loss(trained.model, held_out)
    assert rows["original"][2] == f"{loss:.4f}" and loss < unigram_loss(held_out) - 0.5
    exact, _, level0_loss, delta, *_ = rows["level 0"]
    assert (exact, level0_loss, delta) == ("yes", f"{loss:.4f}", "+0.0000")
    for name, cells in rows.items():
        assert float(cells[6].replace(",", "")) > 0              # tokens/s
        if name in ("level 1", "level 2"):
            assert cells[0] == "no (lossy)" and float(cells[3]) == pytest.approx(
                float(cells[2]) - loss, abs=2e-4)
    assert "level 0: exact" in summary
    assert "level 1: lossy by design (freeze_theta removes" in summary
    assert "level 2: lossy by design (freeze_theta, drop_norm remove" in summary
    # every drift figure names the inputs it was measured on
    assert summary.count("on the held-out text") == len(levels)
    calibration = f"on the {CALIBRATION_SEQUENCES}x{trained.sequence_length} calibration text"
    assert summary.count(calibration) == len(levels) - 1
    assert "converted exactly" not in summary


def test_convert_writes_a_report_that_report_reads(tmp_path, capsys):
    path = tmp_path / "variant2.json"
    assert main(["convert", "--zoo", "lact-variant2", "--level", "2", "--json", str(path),
                 "--length", "256"]) == 0
    printed = capsys.readouterr().out
    assert main(["report", str(path)]) == 0
    assert capsys.readouterr().out == printed


def test_refused_conversion_exits_with_status_1(capsys):
    # a LaCT layer whose Θ is updated is not reducible at level 0, and convert is strict (two
    # chunks of 64 show the update: a shorter example traces faster than the model's default)
    assert main(["convert", "--zoo", "lact-layer", "--level", "0", "--length", "128"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "NonReducibleError" in err and "freeze_theta (level >= 1)" in err
