"""Converted checkpoints refuse what they cannot honour: a replayed conversion that computes
another function, a checkpoint ``load`` could not read back, arguments and manifests of the
wrong type — each with a ``ConversionError`` naming what and where, never a raw exception or a
silent wrong answer."""
from __future__ import annotations

import json

import pytest
import torch

import ttt2la
from ttt2la.checkpoint import MANIFEST_NAME, CheckpointError, ManifestError
from ttt2la.zoo import TinyLaCTLM

KW = dict(vocab_size=64, d_model=32, n_layers=1, num_heads=2, chunk_size=8, muon=False)
FACTORY = "ttt2la.zoo:TinyLaCTLM"


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    return ttt2la.convert(TinyLaCTLM(**KW).eval(), 2, (ids,)), ids


@pytest.fixture(scope="module")
def saved(converted, tmp_path_factory):
    model, ids = converted
    directory = tmp_path_factory.mktemp("ck") / "ck"
    ttt2la.save(model, directory, factory=FACTORY, config=KW, example_inputs=(ids,))
    return directory


def edit_manifest(src, dst, edit):
    """A copy of checkpoint ``src`` at ``dst`` whose manifest ``edit`` changed."""
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / MANIFEST_NAME).read_text())
    edit(data)
    (dst / MANIFEST_NAME).write_text(json.dumps(data))
    return dst


# -- a replay computing another function is refused ------------------------------------------------
def test_load_refuses_a_model_with_another_update_rule(saved):
    with pytest.raises(ManifestError, match=r"layer 'blocks.0.ttt': state w1 update rule .*NS5"):
        ttt2la.load(saved, model=TinyLaCTLM(**dict(KW, muon=True)))


def test_load_refuses_a_recorded_config_building_another_function(saved, tmp_path):
    directory = edit_manifest(saved, tmp_path / "ck",
                              lambda d: d["recipe"]["kwargs"].update(muon=True))
    with pytest.raises(ManifestError, match=r"blocks.0.ttt.*update rule"):
        ttt2la.load(directory)


# -- save refuses, writing nothing, a checkpoint load could not read back ------------------------
def assert_nothing_written(directory):
    assert not directory.exists()
    assert [p.name for p in directory.parent.iterdir()] == []       # no temporary leftovers


@pytest.mark.parametrize("example", [
    pytest.param((torch.randn(3),), id="float-vector"),
    pytest.param((torch.full((1, 24), 999),), id="ids-beyond-vocabulary"),
])
def test_save_refuses_example_inputs_the_model_fails_on(converted, tmp_path, example):
    model, _ids = converted
    with pytest.raises(ttt2la.ConversionError, match=r"fails on the example inputs"):
        ttt2la.save(model, tmp_path / "ck", factory=FACTORY, config=KW, example_inputs=example)
    assert_nothing_written(tmp_path / "ck")


def test_save_refuses_a_config_building_another_function(converted, tmp_path):
    model, ids = converted
    with pytest.raises(CheckpointError, match=r"not written.*update rule.*NS5") as e:
        ttt2la.save(model, tmp_path / "ck", factory=FACTORY, config=dict(KW, muon=True),
                    example_inputs=(ids,))
    assert ".partial" not in str(e.value) and str(tmp_path / "ck" / MANIFEST_NAME) in str(e.value)
    assert_nothing_written(tmp_path / "ck")


def test_save_refuses_a_config_whose_replay_fails(converted, tmp_path):
    model, ids = converted
    with pytest.raises(CheckpointError, match=r"not written"):
        ttt2la.save(model, tmp_path / "ck", factory=FACTORY, config=dict(KW, base_lr=float("nan")),
                    example_inputs=(ids,))
    assert_nothing_written(tmp_path / "ck")


# -- arguments of the wrong type ---------------------------------------------------------------------
def local_factory(**kwargs):
    return TinyLaCTLM(**kwargs)


@pytest.mark.parametrize("call, match", [
    (lambda m, ids, d: ttt2la.save(m, None, factory=FACTORY, config=KW, example_inputs=(ids,)),
     "directory must be a path.*None"),
    (lambda m, ids, d: ttt2la.save(m, 5, factory=FACTORY, config=KW, example_inputs=(ids,)),
     "directory must be a path.*int"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=FACTORY, config=[1], example_inputs=(ids,)),
     "config must be a dict.*list"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=FACTORY, config={"x": torch.ones(1)},
                                   example_inputs=(ids,)), "cannot be recorded as JSON"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=lambda **k: TinyLaCTLM(**k), config=KW,
                                   example_inputs=(ids,)), "cannot be imported back"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=5, config=KW, example_inputs=(ids,)),
     "factory must be"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=FACTORY, config=KW, example_inputs=(ids,),
                                   example_kwargs=[1]), "example_kwargs must be a dict"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=FACTORY, config=KW, example_inputs="abc"),
     "example_inputs must be a tensor"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=FACTORY, config=KW, example_inputs=[ids, 1]),
     r"#1 \(int\) is not a tensor"),
    (lambda m, ids, d: ttt2la.save(m, d, factory=FACTORY, config=KW, example_inputs=(ids,),
                                   force="yes"), "force must be True or False"),
], ids=["dir-None", "dir-int", "config-list", "config-tensor", "factory-lambda", "factory-int",
        "kwargs-list", "inputs-str", "inputs-int", "force-str"])
def test_save_refuses_arguments_of_the_wrong_type(converted, tmp_path, call, match):
    model, ids = converted
    with pytest.raises(ttt2la.InvalidInputError, match=match) as e:
        call(model, ids, tmp_path / "ck")
    assert ".partial" not in str(e.value)
    assert_nothing_written(tmp_path / "ck")


def test_save_records_an_importable_factory_by_name(converted, tmp_path):
    model, ids = converted
    ttt2la.save(model, tmp_path / "ck", factory=TinyLaCTLM, config=KW, example_inputs=(ids,))
    recipe = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())["recipe"]
    assert recipe["factory"] == FACTORY
    ttt2la.load(tmp_path / "ck")                        # a bundled model: no opt-in needed


@pytest.mark.parametrize("call, match", [
    (lambda d: ttt2la.load(None), "directory must be a path.*None"),
    (lambda d: ttt2la.load(5), "directory must be a path.*int"),
    (lambda d: ttt2la.load(d, trust_factory="yes"), "trust_factory must be True or False"),
    (lambda d: ttt2la.load(d, trust_remote_code="no"), "trust_remote_code must be True or False"),
])
def test_load_refuses_arguments_of_the_wrong_type(saved, call, match):
    with pytest.raises(ttt2la.InvalidInputError, match=match):
        call(saved)


# -- files and manifests that are not what they claim ------------------------------------------------
def test_a_deeply_nested_manifest_is_a_manifest_error(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text('{"a": ' * 100000 + "1" + "}" * 100000)
    with pytest.raises(ManifestError, match=r"ttt2la.json: .*nested too deeply"):
        ttt2la.load(tmp_path)


def test_cli_report_refuses_a_deeply_nested_json_in_one_line(tmp_path, capsys):
    from ttt2la.cli import main

    (tmp_path / "deep.json").write_text('{"a": ' * 100000 + "1" + "}" * 100000)
    assert main(["report", str(tmp_path / "deep.json")]) == 1
    err = capsys.readouterr().err
    assert "deep.json is not JSON" in err and "Traceback" not in err


def test_a_pt_file_of_other_bytes_is_not_a_torch_checkpoint(tmp_path):
    from ttt2la.checkpoint.errors import UnsafeCheckpointError
    from ttt2la.checkpoint.weights import read_weight_file

    (tmp_path / "weird.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match=r"weird.pt: not a torch checkpoint") as e:
        read_weight_file(tmp_path / "weird.pt")
    assert not isinstance(e.value, UnsafeCheckpointError)


def test_a_missing_weights_file_is_named(saved, tmp_path):
    directory = edit_manifest(saved, tmp_path / "ck", lambda d: d["weights"].update(file="zz"))
    with pytest.raises(CheckpointError, match=r"ck/zz: missing"):
        ttt2la.load(directory)


def test_sha256_of_a_missing_file_is_a_checkpoint_error(tmp_path):
    from ttt2la.checkpoint.weights import sha256_file

    with pytest.raises(CheckpointError, match=r"nothing.bin: cannot read"):
        sha256_file(tmp_path / "nothing.bin")


def set_field(path, value):
    """An edit setting the manifest entry at ``path`` (keys) to ``value``, or deleting it."""
    def edit(data):
        for key in path[:-1]:
            data = data[key]
        if value is DELETE:
            del data[path[-1]]
        else:
            data[path[-1]] = value
    return edit


DELETE = object()


@pytest.mark.parametrize("path, value, match", [
    (("ttt2la_version",), None, "ttt2la_version is None, not a str"),
    (("ttt2la_version",), [1], "ttt2la_version is \\[1\\], not a str"),
    (("torch_version",), 2.1, "torch_version is 2.1, not a str"),
    (("weights", "file"), None, "weights.file is None, not a str"),
    (("weights", "file"), {}, "weights.file is {}, not a str"),
    (("weights", "sha256"), DELETE, "weights records no sha256"),
    (("example_inputs", "sha256"), DELETE, "example_inputs records no sha256"),
    (("example_inputs", "sha256"), None, "example_inputs.sha256 is None, not a str"),
    (("example_inputs", "sha256"), ["x"], "example_inputs.sha256 is \\['x'\\], not a str"),
    (("example_inputs", "kind"), 5, "example_inputs.kind is 5, not one of"),
    (("source", "sha256"), ["x"], "source.sha256 is \\['x'\\], not a str"),
    (("source", "held_in_memory"), "yes", "source.held_in_memory is 'yes', not a bool"),
], ids=lambda v: None)
def test_manifest_fields_of_the_wrong_type_are_refused(saved, tmp_path, path, value, match):
    directory = edit_manifest(saved, tmp_path / "ck", set_field(path, value))
    with pytest.raises(ManifestError, match=match):
        ttt2la.load(directory)


def test_save_compares_the_reloaded_outputs_with_the_saved_model(converted, tmp_path, monkeypatch):
    import ttt2la.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "replay_differences", lambda recorded, replayed: [])
    model, ids = converted
    with pytest.raises(CheckpointError, match=r"computes something else on the example inputs"):
        ttt2la.save(model, tmp_path / "ck", factory=FACTORY, config=dict(KW, muon=True),
                    example_inputs=(ids,))
    assert_nothing_written(tmp_path / "ck")
