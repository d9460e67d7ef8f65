"""Bad input everywhere: each case is answered with one line naming what and where, exit status 2
on the command line (a ``ConversionError`` subclass from the API), and nothing is written."""
from __future__ import annotations

import copy
import json
import re
import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from safetensors.torch import save_file

import ttt2la
from ttt2la.checkpoint import writing
from ttt2la.checkpoint.manifest import Manifest
from ttt2la.cli import EXIT_BAD_INPUT, main
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, TinyLaCTLM

KWARGS = dict(vocab_size=64, d_model=32, n_layers=1, num_heads=2, chunk_size=16, muon=False)
FACTORY = "ttt2la.zoo:TinyLaCTLM"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A good state dict, its factory kwargs, and a folder for outputs."""
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    model = TinyLaCTLM(**{**KWARGS, "tie_embeddings": False})
    save_file(model.state_dict(), str(root / "good.safetensors"))
    (root / "kwargs.json").write_text(json.dumps({**KWARGS, "tie_embeddings": False}))
    return root


def state_argv(files, weights, *extra, out=None) -> list[str]:
    argv = ["convert", str(weights), "--model", FACTORY, "--config", str(files / "kwargs.json")]
    return argv + list(extra) + (["--out", str(out)] if out is not None else [])


def listing(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def refused(argv, capsys, error: str, *names: str) -> str:
    """Run the command line; it must exit 2 with one line naming ``error`` and every of
    ``names``. Returns that line."""
    assert main(argv) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"ttt2la {argv[0]}: {error}: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# -- the checkpoint named ---------------------------------------------------------------------
def test_a_missing_path(files, tmp_path, capsys):
    refused(state_argv(files, tmp_path / "absent.safetensors", out=tmp_path / "out"), capsys,
            "CheckpointError", "absent.safetensors", "no such file")
    assert listing(tmp_path) == set()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_path(files, tmp_path, capsys):
    locked = tmp_path / "locked.safetensors"
    locked.write_bytes((files / "good.safetensors").read_bytes())
    locked.chmod(0)
    try:
        refused(state_argv(files, locked, out=tmp_path / "out"), capsys, "CheckpointError",
                "locked.safetensors")
    finally:
        locked.chmod(0o600)
    assert listing(tmp_path) == {"locked.safetensors"}


def test_a_directory_without_weights(files, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no weights here")
    refused(state_argv(files, empty, out=tmp_path / "out"), capsys, "CheckpointError",
            str(empty), "without weights")
    assert listing(tmp_path) == {"empty", "empty/notes.txt"}


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file(files, tmp_path, capsys, damage):
    good = (files / "good.safetensors").read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good[: len(good) // 2] if damage == "truncated" else b"\x07" * 64 + good[64:])
    refused(state_argv(files, bad, out=tmp_path / "out"), capsys, "CheckpointError",
            "bad.safetensors", "not a valid safetensors file")
    assert listing(tmp_path) == {"bad.safetensors"}


class Payload:
    """Unpickling this would create the file ``marker``: the code a malicious checkpoint runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("suffix, how", [(".pt", "torch.save"), (".bin", "pickle.dump")])
def test_a_pickle_that_would_run_code_is_refused_unrun(files, tmp_path, capsys, suffix, how):
    marker = tmp_path / "payload-ran"
    evil = tmp_path / f"evil{suffix}"
    if how == "torch.save":
        torch.save({"embed.weight": torch.zeros(2), "hook": Payload(marker)}, evil)
    else:
        with open(evil, "wb") as f:
            pickle.dump({"scale": 1.0, "hook": Payload(marker)}, f, protocol=2)
    refused(state_argv(files, evil, out=tmp_path / "out"), capsys, "UnsafeCheckpointError",
            evil.name, "refused", "would run code", "GLOBAL io.open")
    assert not marker.exists(), "the pickle's payload ran"
    assert listing(tmp_path) == {evil.name}
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Payload(control)))      # unpickled, the payload does run
    assert control.exists()
    control.unlink()
    # the same file through the API: refused, never run
    from ttt2la.checkpoint.weights import read_weights
    with pytest.raises(ttt2la.UnsafeCheckpointError, match=evil.name):
        read_weights(evil)
    assert not marker.exists()


def test_weights_that_do_not_fit_the_model(files, tmp_path, capsys):
    other = tmp_path / "other.safetensors"
    save_file(TinyLaCTLM(**{**KWARGS, "d_model": 16, "tie_embeddings": False}).state_dict(),
              str(other))
    refused(state_argv(files, other, out=tmp_path / "out"), capsys, "WeightMismatchError",
            "other.safetensors", "do not fit", "mis-shaped", "embed.weight")
    assert listing(tmp_path) == {"other.safetensors"}


def test_weights_of_another_kind_of_number_do_not_fit(files, tmp_path, capsys):
    """Float weights saved as integers would load truncated (a model of zeros): refused, naming
    each, while a float file of another precision loads cast, as ``load_state_dict`` does."""
    state = TinyLaCTLM(**{**KWARGS, "tie_embeddings": False}).state_dict()
    ints = tmp_path / "ints.safetensors"
    save_file({k: (v * 100).to(torch.int32) for k, v in state.items()}, str(ints))
    refused(state_argv(files, ints, out=tmp_path / "out"), capsys, "WeightMismatchError",
            "ints.safetensors", "another kind of number", "file torch.int32, model torch.float32")
    assert listing(tmp_path) == {"ints.safetensors"}
    from ttt2la.checkpoint.weights import weight_problems
    model = TinyLaCTLM(**{**KWARGS, "tie_embeddings": False})
    assert weight_problems(model, {k: v.half() for k, v in state.items()}) == []


@pytest.mark.parametrize("factory, says", [("no_such_module_for_ttt2la:build", "cannot import"),
                                           ("ttt2la.zoo:NoSuchModel", "has no NoSuchModel"),
                                           ("ttt2la.zoo.TinyLaCTLM", "expected pkg.module")])
def test_an_unknown_factory(files, tmp_path, capsys, factory, says):
    argv = ["convert", str(files / "good.safetensors"), "--model", factory,
            "--out", str(tmp_path / "out")]
    refused(argv, capsys, "CheckpointError", factory, says)
    assert listing(tmp_path) == set()


def test_a_factory_that_fails_on_its_kwargs(files, tmp_path, capsys):
    (tmp_path / "wrong.json").write_text(json.dumps({"no_such_argument": 1}))
    argv = ["convert", str(files / "good.safetensors"), "--model", FACTORY,
            "--config", str(tmp_path / "wrong.json"), "--out", str(tmp_path / "out")]
    refused(argv, capsys, "CheckpointError", FACTORY, "factory failed", "no_such_argument")
    assert listing(tmp_path) == {"wrong.json"}


@pytest.mark.parametrize("content, says", [("{not json", "not JSON"), ("[1, 2]", "JSON object")])
def test_a_config_that_is_not_a_json_object(files, tmp_path, capsys, content, says):
    (tmp_path / "cfg.json").write_text(content)
    argv = ["convert", str(files / "good.safetensors"), "--model", FACTORY,
            "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "out")]
    refused(argv, capsys, "CheckpointError", "cfg.json", says)
    assert listing(tmp_path) == {"cfg.json"}


def test_a_config_written_inline(files, tmp_path):
    """``--config`` takes the JSON object itself as well as a file holding it."""
    out = tmp_path / "out"
    argv = ["convert", str(files / "good.safetensors"), "--model", FACTORY, "--config",
            json.dumps({**KWARGS, "tie_embeddings": False}), "--out", str(out)]
    assert main(argv) == 0
    manifest = Manifest.read(out)
    assert manifest.recipe["kwargs"] == {**KWARGS, "tie_embeddings": False}


def test_an_inline_config_that_is_not_json(files, tmp_path, capsys):
    argv = ["convert", str(files / "good.safetensors"), "--model", FACTORY, "--config",
            '{"d_model": 32', "--out", str(tmp_path / "out")]
    refused(argv, capsys, "CheckpointError", "--config", "not a JSON object")
    assert listing(tmp_path) == set()


def test_an_inline_config_that_is_json_but_no_object(files, tmp_path, capsys):
    argv = ["convert", str(files / "good.safetensors"), "--model", FACTORY, "--config",
            "[1, 2]", "--out", str(tmp_path / "out")]
    refused(argv, capsys, "CheckpointError", "--config", "expected a JSON object", "list")
    assert listing(tmp_path) == set()


@pytest.mark.parametrize("extra", [["--length", "128"], ["--batch", "3"],
                                   ["--batch", "3", "--length", "128"]])
def test_an_example_shape_beside_a_batch_or_length(files, tmp_path, capsys, extra):
    """``--example-shape`` gives both; the others are refused, not silently dropped."""
    argv = state_argv(files, files / "good.safetensors", "--example-shape", "1,64", *extra,
                      out=tmp_path / "out")
    refused(argv, capsys, "InvalidInputError", *extra[::2], "--example-shape")
    assert listing(tmp_path) == set()


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1", "x"])
def test_a_seed_torch_cannot_take(files, tmp_path, capsys, command, seed):
    with pytest.raises(SystemExit) as exc:
        main([command, "--zoo", "lact-variant2", "--seed", seed])
    assert exc.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "argument --seed: expected an integer from 0 to 2**64 - 1" in err and seed in err


def test_a_state_dict_without_its_factory(files, tmp_path, capsys):
    refused(["convert", str(files / "good.safetensors"), "--out", str(tmp_path / "out")], capsys,
            "CheckpointError", "good.safetensors", "--model pkg.module:factory")
    assert listing(tmp_path) == set()


def test_hf_remote_code_needs_trust(files, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(
        {"model_type": "someone-elses", "auto_map": {"AutoModelForCausalLM": "modeling.M"}}))
    (hf / "model.safetensors").write_bytes((files / "good.safetensors").read_bytes())
    (hf / "modeling.py").write_text(f"open({str(tmp_path / 'code-ran')!r}, 'w')\n")
    refused(["convert", str(hf), "--out", str(tmp_path / "out")], capsys, "CheckpointError",
            "config.json", "--trust-remote-code")
    assert listing(tmp_path) == {"hf", "hf/config.json", "hf/model.safetensors", "hf/modeling.py"}


@pytest.mark.parametrize("code, says", [
    ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    ("def build(:\n", "SyntaxError"),
])
def test_a_factory_module_that_fails_on_import(files, tmp_path, capsys, monkeypatch, code, says):
    """A ``--model`` module whose own code fails on import (as a manifest's trusted factory
    does too: both go through ``resolve_factory``) is one line naming it, not a traceback."""
    (tmp_path / "failing_factory.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "failing_factory", raising=False)
    argv = ["convert", str(files / "good.safetensors"), "--model", "failing_factory:build"]
    refused(argv, capsys, "CheckpointError", "failing_factory", says)


def test_out_is_read_back_before_it_is_written(files, tmp_path, capsys, monkeypatch):
    """``--out`` reads the checkpoint back as ``load`` will (as ``ttt2la.save`` does): a factory
    that builds another function the second time (Newton–Schulz switched on) is refused, and
    nothing is written."""
    (tmp_path / "drifting_factory.py").write_text(
        "import itertools\n"
        "from ttt2la.zoo import TinyLaCTLM\n"
        "_builds = itertools.count()\n"
        "def build(**kwargs):\n"
        "    return TinyLaCTLM(**{**kwargs, 'muon': next(_builds) > 0, 'muon_steps': 1})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "drifting_factory", raising=False)
    out = tmp_path / "out"
    argv = ["convert", str(files / "good.safetensors"), "--model", "drifting_factory:build",
            "--config", str(files / "kwargs.json"), "--out", str(out)]
    line = refused(argv, capsys, "CheckpointError", str(out), "not written", "load")
    assert "tmp" not in line.split(str(out), 1)[1].split()[0], line
    assert not out.exists()


@pytest.mark.parametrize("code, says", [(None, "OSError"),
                                        ("raise RuntimeError('broken')\n", "RuntimeError: broken")])
def test_hf_remote_code_that_is_missing_or_fails(files, tmp_path, capsys, code, says):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "auto_map": {"AutoModel": "modeling.M"}}))
    (hf / "model.safetensors").write_bytes((files / "good.safetensors").read_bytes())
    if code is not None:
        (hf / "modeling.py").write_text(code)
    refused(["convert", str(hf), "--trust-remote-code"], capsys, "CheckpointError",
            "config.json", "modeling.M", says)


def test_an_output_that_is_the_current_directory(files, tmp_path, capsys, monkeypatch):
    """``--out . --force`` would replace the directory the command runs in: refused up front."""
    monkeypatch.chdir(tmp_path)
    refused(state_argv(files, files / "good.safetensors", "--force", out="."), capsys,
            "CheckpointError", "--out .", "current directory")
    assert listing(tmp_path) == set()


# -- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["7", "-1", "two"])
def test_a_level_outside_0_to_6(files, tmp_path, capsys, level):
    with pytest.raises(SystemExit) as exc:
        main(state_argv(files, files / "good.safetensors", "--level", level,
                        out=tmp_path / "out"))
    assert exc.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "argument --level: levels run from 0 to 6" in err and level in err
    assert listing(tmp_path) == set()


def test_an_output_path_that_exists(files, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    refused(state_argv(files, files / "good.safetensors", out=tmp_path / "out"), capsys,
            "CheckpointError", str(tmp_path / "out"), "already exists", "--force")
    assert listing(tmp_path) == {"out", "out/mine.txt"}


@pytest.mark.parametrize("force", [False, True])
def test_an_output_path_that_is_or_holds_the_input(files, tmp_path, capsys, force):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes((files / "good.safetensors").read_bytes())
    extra = ["--force"] if force else []
    refused(state_argv(files, weights, *extra, out=weights), capsys, "CheckpointError",
            "w.safetensors", "is the input")
    refused(state_argv(files, weights, *extra, out=tmp_path), capsys, "CheckpointError",
            str(tmp_path), "is the input", "or holds it")
    assert listing(tmp_path) == {"w.safetensors"}
    assert weights.read_bytes() == (files / "good.safetensors").read_bytes()


@pytest.mark.parametrize("option", ["--out", "--json"])
def test_an_empty_output_path_is_refused(files, tmp_path, capsys, monkeypatch, option):
    """``--out ''`` (an unset shell variable, say) is refused, not silently skipped."""
    monkeypatch.setattr(ttt2la, "convert", lambda *a, **k: pytest.fail("converted anyway"))
    monkeypatch.chdir(tmp_path)
    refused([*state_argv(files, files / "good.safetensors"), option, ""], capsys,
            "InvalidInputError", f"{option} is empty")
    assert listing(tmp_path) == set()


def test_an_output_inside_the_input_directory(tmp_path, capsys, monkeypatch):
    """``--out`` inside a checkpoint directory given as input is refused, as ``--json`` is."""
    monkeypatch.setattr(ttt2la, "convert", lambda *a, **k: pytest.fail("converted anyway"))
    (tmp_path / "ckpt").mkdir()
    refused(["convert", str(tmp_path / "ckpt"), "--out", str(tmp_path / "ckpt" / "sub")],
            capsys, "CheckpointError", "lies inside the input", str(tmp_path / "ckpt"))
    assert listing(tmp_path) == {"ckpt"}


def test_a_read_only_output_folder(files, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:
        # root writes into read-only folders; make the system answer as it does for others
        real = writing.tempfile.mkdtemp

        def mkdtemp(*args, dir=None, **kwargs):
            if dir is not None and os.path.samefile(dir, locked):
                raise PermissionError(13, "Permission denied")
            return real(*args, dir=dir, **kwargs)
        monkeypatch.setattr(writing.tempfile, "mkdtemp", mkdtemp)
    try:
        refused(state_argv(files, files / "good.safetensors", out=locked / "out"), capsys,
                "CheckpointError", str(locked / "out"), "cannot write in", "Permission denied")
        assert listing(tmp_path) == {"locked"}
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("where, says", [("missing-folder/r.json", "does not exist"),
                                         ("", "is a directory")])
def test_an_unwritable_json_path_is_refused_before_converting(files, tmp_path, capsys,
                                                              monkeypatch, where, says):
    monkeypatch.setattr(ttt2la, "convert", lambda *a, **k: pytest.fail("converted anyway"))
    path = tmp_path / where if where else tmp_path
    refused(state_argv(files, files / "good.safetensors", "--json", str(path)), capsys,
            "InvalidInputError", "--json", str(path), says)
    assert listing(tmp_path) == set()


def test_json_that_would_overwrite_an_input_or_the_output_is_refused(files, tmp_path, capsys,
                                                                   monkeypatch):
    """``--json`` naming an input (the weights, by name or through a link, their config, the
    example inputs, a file of an input directory) or a file of ``--out`` is refused before any
    work: one line, nothing written, every input as it was."""
    monkeypatch.setattr(ttt2la, "convert", lambda *a, **k: pytest.fail("converted anyway"))
    monkeypatch.setattr(ttt2la, "inspect", lambda *a, **k: pytest.fail("inspected anyway"))
    weights, config, ids = (tmp_path / n for n in ("w.safetensors", "kw.json", "ids.safetensors"))
    weights.write_bytes((files / "good.safetensors").read_bytes())
    config.write_bytes((files / "kwargs.json").read_bytes())
    save_file({"0": torch.zeros(1, 32, dtype=torch.long)}, str(ids))
    (tmp_path / "link.json").symlink_to(weights)
    (tmp_path / "ckpt").mkdir()
    before = {p: p.read_bytes() for p in (weights, config, ids)}
    argv = [str(weights), "--model", FACTORY, "--config", str(config), "--example-inputs", str(ids)]
    for command in ("convert", "inspect"):
        for path in (weights, config, ids, tmp_path / "link.json"):
            refused([command, *argv, "--json", str(path)], capsys, "CheckpointError",
                     f"--json {path}: is the input")
    out = tmp_path / "out"
    refused(["convert", *argv, "--out", str(out), "--json", str(out / "ttt2la.json")], capsys,
            "CheckpointError", "lies inside the --out directory")
    refused(["convert", *argv, "--out", str(out), "--json", str(out)], capsys,
            "CheckpointError", "is the --out directory")
    refused(["convert", str(tmp_path / "ckpt"), "--json", str(tmp_path / "ckpt" / "r.json")],
            capsys, "CheckpointError", "lies inside the input")
    assert {p: p.read_bytes() for p in before} == before
    assert listing(tmp_path) == {"w.safetensors", "kw.json", "ids.safetensors", "link.json",
                                 "ckpt"}


def test_sweep_outputs_are_checked_before_sweeping(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ttt2la, "sweep", lambda *a, **k: pytest.fail("swept anyway"))
    sweep = ["sweep", "--zoo", "lact-variant2", "--levels", "0"]
    for option in ("--json", "--plot"):
        refused([*sweep, option, str(tmp_path / "missing" / "x")], capsys, "InvalidInputError",
                option, "does not exist")
    both = str(tmp_path / "x.json")
    refused([*sweep, "--json", both, "--plot", both], capsys, "CheckpointError",
            "--plot", "is --json")
    assert listing(tmp_path) == set()


def test_a_plot_without_matplotlib_is_refused_before_sweeping(tmp_path, capsys, monkeypatch):
    """Where matplotlib cannot be imported, ``--plot`` is refused up front, saying how to
    install it, not after the sweep's work with a raw ImportError."""
    import sys

    monkeypatch.setattr(ttt2la, "sweep", lambda *a, **k: pytest.fail("swept anyway"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)         # import fails
    refused(["sweep", "--zoo", "lact-variant2", "--levels", "0", "--plot",
             str(tmp_path / "x.png")], capsys, "InvalidInputError", "matplotlib",
            "pip install matplotlib")
    assert listing(tmp_path) == set()


def test_sweep_outputs_are_written_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """A plot interrupted half-way leaves no file: outputs go through a temporary file."""
    class Table:
        def to_json(self):
            return "{}"

        def plot(self, path):
            open(path, "w").write("half a plot")
            raise KeyboardInterrupt

    monkeypatch.setattr(ttt2la, "sweep", lambda *a, **k: Table())
    (tmp_path / "x.png").write_text("an older plot")
    assert main(["sweep", "--zoo", "lact-variant2", "--format", "json", "--json",
                 str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")]) == EXIT_BAD_INPUT
    assert "interrupted" in capsys.readouterr().err
    assert listing(tmp_path) == {"x.json", "x.png"}      # no temporary file left
    assert (tmp_path / "x.png").read_text() == "an older plot"


class _SweptTable:
    """What a stubbed ``ttt2la.sweep`` returns: enough of a ``SweepReport`` to print."""

    def to_json(self):
        return "{}"


def _record_sweep(monkeypatch) -> dict:
    calls = {}

    def sweep(model, calibration=None, **kwargs):
        calls.update(model=model, calibration=calibration, **kwargs)
        return _SweptTable()
    monkeypatch.setattr(ttt2la, "sweep", sweep)
    return calls


def test_sweep_reads_the_model_and_inputs_as_convert_does(files, capsys, monkeypatch):
    """``sweep`` takes ``--example-shape``, ``--model``/``--config`` and a checkpoint the way
    ``convert`` does; its calibration data are drawn the same way, ``--calibration-batch``
    sequences from the next seed."""
    calls = _record_sweep(monkeypatch)
    assert main(["sweep", "--zoo", "per-token", "--example-shape", "2,16,64",
                 "--calibration-batch", "3", "--format", "json"]) == 0
    assert calls["example_inputs"][0].shape == (2, 16, 64)
    assert calls["calibration"][0].shape == (3, 16, 64)
    assert not torch.equal(calls["calibration"][0][:2], calls["example_inputs"][0])
    assert main(["sweep", str(files / "good.safetensors"), "--model", FACTORY, "--config",
                 str(files / "kwargs.json"), "--example-shape", "1,32", "--format", "json"]) == 0
    assert isinstance(calls["model"], TinyLaCTLM)
    assert calls["example_inputs"][0].shape == (1, 32)
    assert calls["calibration"][0].shape == (2, 32)


@pytest.mark.parametrize("extra, error, says", [
    (["--example-inputs", "no-such.safetensors"], "CheckpointError", "no-such.safetensors"),
    (["--model", "no.such:factory"], "InvalidInputError", "--model no.such:factory"),
    (["--config", "{}"], "InvalidInputError", "--config"),
    (["--example-shape", "1,16,64", "--example-inputs", "x.safetensors"], "InvalidInputError",
     "not both"),
])
def test_sweep_refuses_what_convert_refuses(extra, error, says, capsys, monkeypatch):
    calls = _record_sweep(monkeypatch)
    refused(["sweep", "--zoo", "per-token", *extra], capsys, error, says)
    assert calls == {}


class PositionalLM(torch.nn.Module):
    """Token ids in: an embedding plus a learned position parameter held by the model itself."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.pos = torch.nn.Parameter(torch.zeros(1, 1, 32))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        return self.head(self.emb(ids) + self.pos)


def test_a_parameter_beside_the_embedding_still_takes_token_ids():
    """``--example-shape B,L`` and inferred inputs find the embedding past a parameter the
    model holds beside its submodules; a layer holding its own weights starts with none."""
    from ttt2la.checkpoint.example_inputs import spec_from_shape
    from ttt2la.embedding import first_embedding

    model = PositionalLM()
    assert first_embedding(model) is model.emb
    assert spec_from_shape(model, (2, 32))["kind"] == "token_ids"
    assert first_embedding(LaCTFoldedLayer(32, 2, 16)) is None
    assert first_embedding(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Embedding(4, 4))) \
        is None


def test_example_inputs_the_model_fails_on(files, tmp_path, capsys):
    """Float features into a model that starts with an embedding: the model's own error."""
    line = refused(state_argv(files, files / "good.safetensors", "--example-shape", "1,32,8",
                              out=tmp_path / "out"), capsys, "InvalidInputError",
                   "TinyLaCTLM fails on the example inputs", "float32 (1, 32, 8)")
    assert "RuntimeError" in line or "IndexError" in line
    assert listing(tmp_path) == set()


def test_example_ids_out_of_vocabulary(files, tmp_path, capsys):
    save_file({"0": torch.full((1, 32), 1000)}, str(tmp_path / "ids.safetensors"))
    refused(state_argv(files, files / "good.safetensors", "--example-inputs",
                       str(tmp_path / "ids.safetensors"), out=tmp_path / "out"), capsys,
            "InvalidInputError", "fails on the example inputs", "IndexError")
    assert listing(tmp_path) == {"ids.safetensors"}


def test_an_example_inputs_file_that_is_corrupt(files, tmp_path, capsys):
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 10)
    refused(state_argv(files, files / "good.safetensors", "--example-inputs",
                       str(tmp_path / "x.safetensors"), out=tmp_path / "out"), capsys,
            "CheckpointError", "x.safetensors")
    assert listing(tmp_path) == {"x.safetensors"}


# -- interruption -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(files):
    model = TinyLaCTLM(**{**KWARGS, "tie_embeddings": False}).eval()
    return ttt2la.convert(model, level=1, example_inputs=(torch.randint(0, 64, (1, 32)),))


def test_ctrl_c_while_converting_exits_quietly(files, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(ttt2la, "convert", interrupted)
    assert main(state_argv(files, files / "good.safetensors", out=tmp_path / "out")) == \
        EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err == "ttt2la convert: interrupted; nothing was written"
    assert listing(tmp_path) == set()


def test_ctrl_c_while_writing_leaves_nothing(files, converted, tmp_path, capsys, monkeypatch):
    written = []

    def interrupted(self, directory):
        written.extend(p.name for p in directory.iterdir())    # weights are on disk by now
        raise KeyboardInterrupt
    monkeypatch.setattr(ttt2la, "convert", lambda *a, **k: converted)
    monkeypatch.setattr(Manifest, "write", interrupted)
    assert main(state_argv(files, files / "good.safetensors", "--level", "1",
                           out=tmp_path / "out")) == EXIT_BAD_INPUT
    assert "model.safetensors" in written
    assert capsys.readouterr().err.strip().endswith("interrupted; nothing was written")
    assert listing(tmp_path) == set()          # neither the output nor its temporary folder


def test_ctrl_c_after_the_output_is_written_says_so(files, converted, tmp_path, capsys,
                                                   monkeypatch):
    """Interrupted while ``--json`` is written, after ``--out`` is complete: the message names
    the checkpoint that was written, not "nothing was written"."""
    import ttt2la.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(ttt2la, "convert", lambda *a, **k: converted)
    monkeypatch.setattr(cli, "_save_json", interrupted)
    out = tmp_path / "out"
    assert main(state_argv(files, files / "good.safetensors", "--level", "1", "--json",
                           str(tmp_path / "r.json"), out=out)) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"ttt2la convert: interrupted after writing --out {out}; nothing else was written"
    assert (out / "ttt2la.json").is_file() and not (tmp_path / "r.json").exists()


# -- the API ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["weights", "inputs"])
def test_weights_or_inputs_on_the_meta_device(where):
    """A model built on the meta device (shapes, no values) is refused by name, not with the
    RuntimeError of the first value read."""
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    x = torch.randn(1, 32, 32)
    if where == "weights":
        layer, names = layer.to("meta"), r"LaCTFoldedLayer\.\w+"
    else:
        x, names = x.to("meta"), "example input #0"
    for call in (lambda: ttt2la.convert(layer, level=1, example_inputs=(x,)),
                 lambda: ttt2la.inspect(layer, example_inputs=(x,), show=False)):
        with pytest.raises(ttt2la.InvalidInputError, match=f"{names}.* on the meta device"):
            call()


@pytest.mark.parametrize("model, says", [(None, "got None"), (lambda x: x, "got function"),
                                         ("model.pt", "got str")])
def test_convert_and_inspect_need_a_module(model, says):
    with pytest.raises(ttt2la.InvalidInputError, match=f"torch.nn.Module, {says}"):
        ttt2la.convert(model, level=1)
    with pytest.raises(ttt2la.InvalidInputError, match=f"torch.nn.Module, {says}"):
        ttt2la.inspect(model, show=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_example_inputs_that_are_not_finite(bad):
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    x = torch.randn(1, 32, 32)
    x[0, 3, 5] = bad
    for call in (lambda: ttt2la.convert(layer, level=1, example_inputs=(x,)),
                 lambda: ttt2la.inspect(layer, example_inputs=(x,), show=False)):
        with pytest.raises(ttt2la.InvalidInputError,
                           match=r"example input #0 holds 1 NaN or infinite value"):
            call()


@pytest.mark.parametrize("shape", [(1, 0, 32), (0, 32, 32)])
def test_example_inputs_with_an_empty_axis(shape):
    """An empty example (no tokens, no batch) is refused by name, not a ZeroDivisionError from
    the probe's resizing."""
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    for call in (lambda: ttt2la.convert(layer, level=1, example_inputs=(torch.randn(shape),)),
                 lambda: ttt2la.inspect(layer, example_inputs=(torch.randn(shape),), show=False)):
        with pytest.raises(ttt2la.InvalidInputError,
                           match=re.escape(f"example input #0 has shape {shape}, an empty axis")):
            call()


@pytest.mark.parametrize("shape", [(0, 32, 32), (2, 0, 32)])
def test_calibration_inputs_with_an_empty_axis(shape):
    """Calibration without a sequence or a token is refused by name, not a ZeroDivisionError
    from resizing it to the traced batch."""
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    with pytest.raises(ttt2la.InvalidInputError,
                       match=re.escape(f"calibration input #0 has shape {shape}, an empty axis")):
        ttt2la.convert(layer, level=1, example_inputs=(torch.randn(1, 32, 32),),
                       calibration=(torch.randn(shape),))


@pytest.mark.parametrize("where", ["example", "calibration"])
def test_sparse_inputs_are_refused_by_name(where):
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    x = torch.randn(1, 32, 32)
    inputs = {where: (x.to_sparse(),)} if where == "calibration" else \
        {"example_inputs": (x.to_sparse(),)}
    inputs = {"example_inputs": (x,), **inputs} if where == "calibration" else inputs
    with pytest.raises(ttt2la.InvalidInputError,
                       match=f"{where} input #0 is a sparse_coo tensor.*dense"):
        ttt2la.convert(layer, level=1, **inputs)


@pytest.mark.parametrize("make, error", [
    (lambda: torch.randn(1, 32, 16), "RuntimeError"),            # wrong width
    (lambda: torch.randn(1, 32, 32, dtype=torch.float64), "RuntimeError"),   # wrong dtype
])
def test_example_inputs_the_layer_rejects(make, error):
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    with pytest.raises(ttt2la.InvalidInputError,
                       match=f"LaCTFoldedLayer fails on the example inputs .* {error}: "):
        ttt2la.convert(layer, level=1, example_inputs=(make(),))


def test_ids_out_of_vocabulary_through_the_api():
    model = TinyLaCTLM(**KWARGS)
    with pytest.raises(ttt2la.InvalidInputError,
                       match=r"TinyLaCTLM fails on the example inputs \(int64 \(1, 32\)\) at "
                             r".*lm\.py:\d+: IndexError"):
        ttt2la.convert(model, level=1, example_inputs=(torch.full((1, 32), 64),))


@pytest.mark.parametrize("level", [7, -1, 1.5, 2.0, True, "2", torch.tensor(2.0),
                                   torch.tensor([1, 2])])
def test_convert_levels_outside_0_to_6(level):
    with pytest.raises(ttt2la.InvalidInputError, match="level must be an integer from 0 to 6"):
        ttt2la.convert(LaCTFoldedLayer(32, 2, 16), level=level)


@pytest.mark.parametrize("level", [np.int64(1), torch.tensor(1)])
def test_convert_takes_a_level_of_any_integer_type(level):
    """A level read from a config array or a tensor is the integer it holds."""
    torch.manual_seed(0)
    fast = ttt2la.convert(LaCTFoldedLayer(32, 2, 16, muon=False), level=level,
                          example_inputs=(torch.randn(1, 32, 32),))
    assert fast.ttt2la_report.level == 1 and type(fast.ttt2la_report.level) is int


def test_save_needs_a_converted_model_and_a_free_path(converted, tmp_path):
    with pytest.raises(ttt2la.InvalidInputError, match="not returned by ttt2la.convert"):
        ttt2la.save(TinyLaCTLM(**KWARGS), tmp_path / "out")
    with pytest.raises(ttt2la.InvalidInputError, match="needs the example_inputs"):
        ttt2la.save(converted, tmp_path / "out", factory=FACTORY)
    with pytest.raises(ttt2la.CheckpointError,
                       match="directory .*: already exists; .* pass force=True to replace it"):
        ttt2la.save(converted, tmp_path, factory=FACTORY)
    with pytest.raises(ttt2la.CheckpointError, match="factory 'nope:build': unknown factory"):
        ttt2la.save(converted, tmp_path / "out", factory="nope:build",
                    example_inputs=(torch.randint(0, 64, (1, 32)),))
    assert listing(tmp_path) == set()


def test_save_refuses_a_checkpoint_load_could_not_read_back(converted, tmp_path):
    """A parametrization registered after conversion, a config the factory does not take, or
    one that ties weights the model holds apart, would write a checkpoint that ``load`` fails on
    or — tied weights — reads back as another model, silently: refused before anything is
    written."""
    ids = torch.randint(0, 64, (1, 32))
    config = {**KWARGS, "tie_embeddings": False}          # as the fixture was built
    with pytest.raises(ttt2la.CheckpointError,
                       match=r"not written, .*:TinyLaCTLM does not take the config .*unexpected "
                             r"keyword"):
        ttt2la.save(converted, tmp_path / "out", factory=FACTORY, config={**config, "dim": 3},
                    example_inputs=(ids,))
    with pytest.raises(ttt2la.CheckpointError,
                       match=r"not written, .*tied in the model but given different values: "
                             r"embed\.weight and lm_head\.weight"):
        ttt2la.save(converted, tmp_path / "out", factory=FACTORY, config=KWARGS,
                    example_inputs=(ids,))
    layer = copy.deepcopy(converted)
    parametrize.register_parametrization(layer.blocks[0].ttt.o_proj, "weight", _Twice())
    with pytest.raises(ttt2la.CheckpointError,
                       match=r"not written, since load could not read it back: .* unexpected "
                             r"blocks\.0\.ttt\.o_proj\.parametrizations\.weight\.original.*"
                             r"remove_parametrizations"):
        ttt2la.save(layer, tmp_path / "out", factory=FACTORY, config=config, example_inputs=(ids,))
    assert listing(tmp_path) == set()
    ttt2la.save(converted, tmp_path / "out", factory=FACTORY, config=config, example_inputs=(ids,))
    assert "out" in listing(tmp_path)


def test_weights_a_model_ties_but_a_file_holds_apart_are_refused(tmp_path):
    """Loading distinct embedding and output weights into a model that ties them would load one
    of them twice: another model, without a word."""
    from ttt2la.checkpoint.weights import fit_weights

    model = TinyLaCTLM(**KWARGS)                          # ties lm_head to embed
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors["embed.weight"] + 1
    with pytest.raises(ttt2la.WeightMismatchError,
                       match="tied in the model but given different values: embed.weight and "
                             "lm_head.weight"):
        fit_weights(model, tensors, tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["embed.weight"].clone()
    fit_weights(model, tensors, tmp_path / "model.safetensors")     # the same values: fine


class _Twice(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("argument, value, says", [
    ("strict", "False", "strict must be True or False, got 'False'"),
    ("inplace", 1, "inplace must be True or False, got 1"),
    ("calibration", 5, "calibration must be a tensor or a tuple of the model's positional"),
    ("folds", [1], r"folds must be \{layer path: \{pass name: constants\}\}.*got list"),
    ("folds", {"": "absorb_lr"}, r"folds must be .*got a dict of str to str"),
])
def test_convert_arguments_of_the_wrong_kind(argument, value, says):
    """A switch that is merely truthy, calibration or folds of another form: refused by name
    before any work, not a raw TypeError from deep inside, nor silently read as something else."""
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    with pytest.raises(ttt2la.InvalidInputError, match=says):
        ttt2la.convert(layer, level=1, example_inputs=(torch.randn(1, 32, 32),), **{argument: value})


@pytest.mark.parametrize("folds, says", [
    ({"blocks.9.ttt": {"absorb_lr": {}}}, r"folds names the layer 'blocks.9.ttt', and the model's "
                                          r"TTT layers are 'blocks.0.ttt'"),
    ({"blocks.0.ttt": {"absorb_learning_rate": {}}}, r"name 'absorb_learning_rate', which is no "
                                                     r"pass; the passes are freeze_theta, "),
])
def test_folds_naming_no_layer_or_no_pass_are_refused(folds, says):
    """Folds for a layer or a pass that does not exist would be ignored, and the conversion would
    measure its constants again where the user asked to replay them: refused, listing what exists."""
    model = TinyLaCTLM(**KWARGS)
    with pytest.raises(ttt2la.InvalidInputError, match=says):
        ttt2la.convert(model, level=1, example_inputs=(torch.randint(0, 64, (1, 32)),), folds=folds)


def test_folds_for_a_model_that_is_its_layer_name_its_empty_path():
    layer = LaCTFoldedLayer(32, 2, 16, muon=False)
    with pytest.raises(ttt2la.InvalidInputError,
                       match=r"the model's TTT layers are '' \(the model itself\)"):
        ttt2la.convert(layer, level=1, example_inputs=(torch.randn(1, 32, 32),),
                       folds={"ttt": {}})


@pytest.mark.parametrize("arguments, says", [
    (dict(levels=[9]), "levels must be integers from 0 to 6, got 9"),
    (dict(levels="12"), "levels must be a list of integers from 0 to 6, got '12'"),
    (dict(levels=3), "levels must be a list of integers from 0 to 6, got 3"),
    (dict(levels=[]), "levels is empty"),
    (dict(time_budget=-1.0), "time_budget must be a positive number of seconds, got -1.0"),
    (dict(time_budget=float("nan")), "time_budget must be a positive number of seconds, got nan"),
    (dict(progress=5), "progress must be a function taking a message, got int"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_sweep_arguments_of_the_wrong_kind(arguments, says):
    with pytest.raises(ttt2la.InvalidInputError, match=re.escape(says) if "(" in says else says):
        ttt2la.sweep(LaCTFoldedLayer(32, 2, 16, muon=False),
                     example_inputs=(torch.randn(1, 32, 32),), **arguments)


def test_sweep_needs_a_module():
    with pytest.raises(ttt2la.InvalidInputError, match="torch.nn.Module, got None"):
        ttt2la.sweep(None, example_inputs=(torch.randn(1, 32, 32),))


class _GradOnlyInTraining(torch.nn.Module):
    """An inner gradient by ``torch.autograd.grad`` of a fast weight derived from a parameter,
    with no ``enable_grad``/``requires_grad_`` of its own: it runs only while gradients are
    recorded, and fails under ``torch.no_grad()``."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.kv = torch.nn.Linear(d, 2 * d, bias=False)
        self.W0 = torch.nn.Parameter(torch.zeros(d, d))

    def forward(self, x):
        k, v = self.kv(x).chunk(2, -1)
        W = self.W0.expand(x.shape[0], -1, -1)
        outs = []
        for s in range(0, x.shape[1], 4):
            kc, vc = k[:, s:s + 4], v[:, s:s + 4]
            W = W - self.inner_gradient(lambda W: -(kc @ W * vc).sum(), W)
            outs.append(kc @ W)
        return torch.cat(outs, 1)

    def inner_gradient(self, loss_of, W):
        return torch.autograd.grad(loss_of(W), W, create_graph=True)[0]


def test_a_layer_whose_inner_gradient_needs_the_callers_grad_mode_is_told_what_to_do():
    layer = _GradOnlyInTraining()
    x = torch.randn(2, 8, 8)
    layer(x)                                      # runs while gradients are recorded
    with pytest.raises(ttt2la.InvalidInputError,
                       match=r"does not require grad and does not have a grad_fn\. The model runs here without gradients, "
                             r"as inference under torch\.no_grad\(\) does.*torch\.enable_grad\(\) "
                             r"with requires_grad_\(\)"):
        ttt2la.convert(layer, level=0, example_inputs=(x,))


class _FastWeightMadeToRequireGrad(_GradOnlyInTraining):
    """The fast weight made to require grad inside ``enable_grad`` only where it already can:
    without gradients its expand of ``W0`` requires none, and ``autograd.grad`` fails with
    another message than "does not require grad"."""

    def inner_gradient(self, loss_of, W):
        with torch.enable_grad():
            Wg = W if W.requires_grad else W.detach().requires_grad_()
            return torch.autograd.grad(loss_of(W), Wg, create_graph=True)[0]


def test_a_layer_that_runs_only_with_gradients_is_told_so_whatever_its_error():
    layer = _FastWeightMadeToRequireGrad()
    x = torch.randn(2, 8, 8)
    layer(x)
    with pytest.raises(ttt2la.InvalidInputError,
                       match=r"The model runs here without gradients, as inference under "
                             r"torch\.no_grad\(\) does") as refused:
        ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert "pass inputs the model accepts" not in str(refused.value)


@pytest.mark.parametrize("entry", ["convert", "inspect"])
def test_a_torchscript_model_is_refused_as_compiled_not_blamed_on_its_inputs(entry):
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    x = torch.randn(2, 16, 32)
    call = (lambda: ttt2la.convert(scripted, level=0, example_inputs=(x,))) if entry == "convert" \
        else (lambda: ttt2la.inspect(scripted, example_inputs=(x,), show=False))
    with pytest.raises(ttt2la.InvalidInputError, match="TorchScript module .*convert the Python"):
        call()


def test_a_forward_taking_keywords_only_converts_from_example_kwargs():
    """A keyword-only forward given only ``example_kwargs`` is called with those: no positional
    inputs are made up for it, nor asked for."""
    from ttt2la.zoo import PerTokenTTTLayer

    class KeywordsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = PerTokenTTTLayer(32, 2)

        def forward(self, *, x):
            return self.layer(x)

    torch.manual_seed(0)
    model, x = KeywordsOnly().eval(), torch.randn(2, 16, 32)
    converted = ttt2la.convert(model, level=0, example_kwargs={"x": x})
    assert converted.ttt2la_report.exact
    y = torch.randn(3, 24, 32)
    assert rel_rms_error(converted(x=y), model(x=y)) <= 1e-5


def test_example_inputs_whose_products_overflow_are_named_not_called_a_bug():
    """Features of 1e30 overflow fp32 in any product; the plan sums products in another order
    than the loop, so its check fails there: the message says the inputs overflow, not that
    the lowering is at fault."""
    from ttt2la.zoo import PerTokenTTTLayer

    torch.manual_seed(0)
    layer = PerTokenTTTLayer(32, 2).eval()
    with pytest.raises(ttt2la.InvalidInputError, match=r"reach \S+e\+30 in float32, beyond "
                                                       r"1.84e\+19, so products of them overflow"):
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 32) * 1e30,))
