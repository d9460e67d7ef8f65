"""Converted checkpoints: convert -> save -> ``ttt2la.load`` gives the in-memory converted model's
outputs exactly, for the bundled LM, a state dict + factory and a Hugging Face directory; and
``load`` refuses a checkpoint that does not match its manifest, naming the file."""
from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import ttt2la
from ttt2la.checkpoint import MANIFEST_NAME, MANIFEST_VERSION, REPORT_NAME
from ttt2la.cli import main
from ttt2la.passes import MAX_LEVEL
from ttt2la.zoo import TinyLaCTLM

LM_KWARGS = dict(vocab_size=64, d_model=32, n_layers=1, num_heads=2, chunk_size=16, muon=False)
LM_FACTORY = "ttt2la.zoo:TinyLaCTLM"
LEVELS = tuple(range(MAX_LEVEL + 1))      # every level: lossy ones round-trip their folds


def token_ids(batch: int, length: int, seed: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, x):
    with torch.no_grad():
        return model(x)


def assert_same_outputs(a, b, inputs):
    """Identical (bit for bit) outputs on inputs of other batch sizes and lengths than the
    example, one ending inside a chunk."""
    for x in inputs:
        ya, yb = run(a, x), run(b, x)
        assert ya.shape == yb.shape
        assert torch.equal(ya, yb), (tuple(x.shape), (ya - yb).abs().max().item())


# -- the bundled LM, through the API ---------------------------------------------------------------
@pytest.fixture(scope="module")
def lm_checkpoints(tmp_path_factory):
    """The bundled LM (tied embeddings) converted at every level, saved, and loaded back."""
    torch.manual_seed(0)
    model = TinyLaCTLM(**LM_KWARGS).eval()
    example = token_ids(1, 64, seed=1)
    out = {}
    for level in LEVELS:
        converted = ttt2la.convert(model, level=level, example_inputs=(example,),
                                   strict=level > 0)
        directory = tmp_path_factory.mktemp("lm") / f"level{level}"
        ttt2la.save(converted, directory, factory=LM_FACTORY, config=LM_KWARGS,
                    example_inputs=(example,))
        out[level] = (converted, directory, ttt2la.load(directory))
    return model, out


@pytest.mark.parametrize("level", LEVELS)
def test_bundled_lm_round_trip_is_exact(lm_checkpoints, level):
    _model, out = lm_checkpoints
    converted, directory, loaded = out[level]
    assert_same_outputs(converted, loaded, [token_ids(2, 100, seed=2), token_ids(1, 16, seed=3)])
    assert loaded.ttt2la_report.level == level
    for (name, a), (_, b) in zip(converted.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.embed.weight         # the tie survives


def test_saved_directory_holds_weights_manifest_and_report(lm_checkpoints):
    model, out = lm_checkpoints
    _converted, directory, _loaded = out[2]
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["example_inputs.safetensors", "model.safetensors", REPORT_NAME,
                     MANIFEST_NAME]
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    assert manifest["version"] == MANIFEST_VERSION and manifest["level"] == 2
    assert manifest["torch_version"] == torch.__version__
    assert manifest["recipe"] == {"kind": "factory", "factory": LM_FACTORY, "kwargs": LM_KWARGS}
    layers = manifest["report"]["layers"]
    assert [layer["module_path"] for layer in layers] == ["blocks.0.ttt"]
    assert [(p["name"], p["status"]) for p in layers[0]["passes"]] == \
        [("freeze_theta", "applied"), ("drop_norm", "applied")]
    assert layers[0]["schedule"] == "parallel"
    # the original parameter names, the tied weight stored once
    assert set(manifest["weights"]["tensors"]) == set(model.state_dict()) - {"lm_head.weight"}
    assert "## Checkpoint" in (directory / REPORT_NAME).read_text()


def test_load_into_a_given_model(lm_checkpoints):
    _model, out = lm_checkpoints
    converted, directory, _loaded = out[1]
    fresh = TinyLaCTLM(**LM_KWARGS)          # other random weights: replaced by the saved ones
    loaded = ttt2la.load(directory, model=fresh)
    assert_same_outputs(converted, loaded, [token_ids(1, 40, seed=4)])
    assert not hasattr(fresh, "ttt2la_report")      # the given model is left as it was


def test_load_compiles_the_plans_when_asked(lm_checkpoints):
    """``load(compile=...)`` passes convert's choice on: the loaded layers' plans run under the
    compiler and compute what the saved model computes; a bad value is refused first."""
    _model, out = lm_checkpoints
    converted, directory, _loaded = out[1]
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        loaded = ttt2la.load(directory, compile="aot_eager")
        assert_same_outputs(converted, loaded, [token_ids(1, 40, seed=4)])
        torch._dynamo.reset()
    runs = [v for layer in loaded.ttt2la_report.layers for v in layer.runs.values()]
    assert runs and all(v.endswith("under torch.compile (aot_eager)") for v in runs)
    with pytest.raises(ttt2la.InvalidInputError, match="names no torch.compile backend"):
        ttt2la.load(directory, compile="no-such-backend")


def test_save_refuses_an_existing_path_unless_forced(lm_checkpoints, tmp_path):
    _model, out = lm_checkpoints
    converted, directory, _ = out[1]
    target = tmp_path / "again"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ttt2la.CheckpointError, match="already exists"):
        ttt2la.save(converted, target, factory=LM_FACTORY, config=LM_KWARGS,
                    example_inputs=(token_ids(1, 64, seed=1),))
    assert (target / "keep.txt").read_text() == "mine"
    ttt2la.save(converted, target, factory=LM_FACTORY, config=LM_KWARGS,
                example_inputs=(token_ids(1, 64, seed=1),), force=True)
    assert not (target / "keep.txt").exists() and (target / MANIFEST_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


# -- load refuses a checkpoint that does not match its manifest --------------------------------
@pytest.fixture
def lm_copy(lm_checkpoints, tmp_path):
    _model, out = lm_checkpoints
    copy = tmp_path / "copy"
    shutil.copytree(out[1][1], copy)
    return copy


def test_load_refuses_an_unknown_manifest_version(lm_copy):
    manifest = json.loads((lm_copy / MANIFEST_NAME).read_text())
    manifest["version"] = MANIFEST_VERSION + 1
    (lm_copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ttt2la.ManifestError, match=f"{MANIFEST_NAME}.*unknown manifest version"):
        ttt2la.load(lm_copy)


@pytest.mark.parametrize("field, value, says", [
    ("files", None, "files is None"), ("report", None, "report is None"),
    ("weights", 5, "weights is 5"), ("level", "2", "level is '2'"),
    ("level", 9, "level is 9, and levels run from 0 to 6"),
    ("files", ["../model.safetensors"], "not the name of a file"),
    ("recipe", {"kind": "zoo", "name": ["lact-lm"]}, "malformed model recipe"),
    ("example_inputs", {"kind": "normal", "shape": [1, -5, 32], "dtype": "float32", "seed": 0},
     "malformed example-input spec"),
    ("report", {"kind": "conversion", "version": 1, "level": 1, "backend": "torch",
                "strict": True, "layers": [1]}, "layers[0] is int 1, not an object")])
def test_load_refuses_a_malformed_manifest(lm_copy, field, value, says):
    """A manifest is read, never trusted: a field of another type, a file outside the
    directory or example inputs that cannot be built is a ``ManifestError`` naming the file."""
    manifest = json.loads((lm_copy / MANIFEST_NAME).read_text())
    manifest[field] = value
    (lm_copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ttt2la.ManifestError, match=f"{MANIFEST_NAME}: .*{re.escape(says)}"):
        ttt2la.load(lm_copy)


def test_load_refuses_a_recipe_that_builds_another_loop(lm_copy):
    """The replayed conversion's loop is compared with the recorded one: a recipe edited to
    another chunk size builds a model that is not the checkpoint's."""
    manifest = json.loads((lm_copy / MANIFEST_NAME).read_text())
    chunk = manifest["recipe"]["kwargs"]["chunk_size"]
    manifest["recipe"]["kwargs"]["chunk_size"] = chunk // 2
    (lm_copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ttt2la.ManifestError,
                       match=f"{MANIFEST_NAME}: the replayed conversion differs .*chunk size "
                             f"{chunk} recorded, {chunk // 2} replayed"):
        ttt2la.load(lm_copy)


def test_load_refuses_weights_whose_hash_differs(lm_copy):
    from safetensors.torch import load_file

    tensors = load_file(str(lm_copy / "model.safetensors"))
    tensors["embed.weight"][0, 0] += 1.0
    save_file(tensors, str(lm_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ttt2la.WeightMismatchError, match=r"model\.safetensors.*sha256"):
        ttt2la.load(lm_copy)


@pytest.mark.parametrize("name", [MANIFEST_NAME, "model.safetensors", REPORT_NAME,
                                  "example_inputs.safetensors"])
def test_load_refuses_a_missing_file(lm_copy, name):
    (lm_copy / name).unlink()
    with pytest.raises(ttt2la.CheckpointError, match=f"{name}.*missing"):
        ttt2la.load(lm_copy)


def test_load_refuses_a_model_of_other_shapes(lm_copy):
    other = TinyLaCTLM(**{**LM_KWARGS, "d_model": 16})
    with pytest.raises(ttt2la.WeightMismatchError,
                       match=r"model\.safetensors: the weights do not fit.*mis-shaped"):
        ttt2la.load(lm_copy, model=other)


def test_load_refuses_a_missing_directory(tmp_path):
    with pytest.raises(ttt2la.CheckpointError, match="nowhere: no such directory"):
        ttt2la.load(tmp_path / "nowhere")


# -- a factory named in a manifest runs only when the caller trusts it --------------------------
def name_in_manifest(directory, recipe: dict) -> None:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["recipe"] = recipe
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_manifest_cannot_make_load_call_what_it_names(lm_copy, tmp_path, capsys):
    """A checkpoint from someone else names ``os:system`` as its factory: neither ``load`` nor
    the commands that read a converted checkpoint call it; each says how to opt in."""
    marker = tmp_path / "ran"
    name_in_manifest(lm_copy, {"kind": "factory", "factory": "os:system",
                               "kwargs": {"command": f"touch {marker}"}})
    with pytest.raises(ttt2la.UnsafeCheckpointError,
                       match=r"ttt2la\.json: names the factory 'os:system'.*trust_factory=True"):
        ttt2la.load(lm_copy)
    for argv in (["convert", str(lm_copy), "--level", "1", "--out", str(tmp_path / "out")],
                 ["inspect", str(lm_copy)], ["generate", str(lm_copy), "--tokens", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "UnsafeCheckpointError" in err and "--trust-factory" in err, err
        assert len(err.splitlines()) == 1, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_users_factory_in_a_manifest_needs_trust(lm_copy):
    name_in_manifest(lm_copy, {"kind": "factory", "factory": "ckpt_nowhere_models:build"})
    with pytest.raises(ttt2la.UnsafeCheckpointError, match="'ckpt_nowhere_models:build'"):
        ttt2la.load(lm_copy)
    with pytest.raises(ttt2la.CheckpointError, match="cannot import ckpt_nowhere_models"):
        ttt2la.load(lm_copy, trust_factory=True)        # trusted: imported (and missing here)


@pytest.mark.parametrize("spec, bundled", [
    ("ttt2la.zoo:TinyLaCTLM", True), ("ttt2la.zoo:lact_layer", True),
    ("ttt2la.zoo:torch.load", False), ("ttt2la.zoo:STEPS", False), ("ttt2la.zoo.lm:torch", False),
    ("os:system", False), ("builtins:exec", False)])
def test_only_bundled_models_need_no_trust(spec, bundled):
    from ttt2la.checkpoint.trust import is_bundled_factory

    assert is_bundled_factory(spec) is bundled


def test_a_manifest_cannot_grant_trust_remote_code(tmp_path):
    """A Hugging Face recipe records that its class is the directory's own code; the caller's
    ``trust_remote_code`` is still needed to run it."""
    from ttt2la.checkpoint import Recipe

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "x", "auto_map": {"AutoModel": "modeling_x.X"}}))
    recipe = Recipe("hf", auto_class="AutoModel", model_class="modeling_x.X",
                    trust_remote_code=True)
    with pytest.raises(ttt2la.CheckpointError, match="--trust-remote-code"):
        recipe.build(tmp_path)


# -- a state dict and a factory, through the command line --------------------------------------
USER_MODULE = '''
import torch
from ttt2la.zoo import LaCTFoldedLayer


class FeatureModel(torch.nn.Module):
    """A user's model: a projection, one LaCT layer, a head; features in, features out."""

    def __init__(self, d_in, d_model, num_heads, chunk_size):
        super().__init__()
        self.proj = torch.nn.Linear(d_in, d_model)
        self.ttt = LaCTFoldedLayer(d_model, num_heads, chunk_size, muon=False)
        self.head = torch.nn.Linear(d_model, d_in)

    def forward(self, x):
        return self.head(self.ttt(self.proj(x)))


def build(**kwargs):
    return FeatureModel(**kwargs)
'''
USER_KWARGS = {"d_in": 8, "d_model": 32, "num_heads": 2, "chunk_size": 16}


@pytest.fixture(scope="module")
def user_package(tmp_path_factory):
    root = tmp_path_factory.mktemp("userpkg")
    (root / "ckpt_user_models.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("ckpt_user_models", None)


@pytest.fixture(scope="module")
def factory_checkpoint(user_package, tmp_path_factory):
    """A .pt state dict converted by ``ttt2la convert --model ... --out``, and the same model
    converted in memory on the same example inputs."""
    import ckpt_user_models

    torch.manual_seed(5)
    model = ckpt_user_models.build(**USER_KWARGS).eval()
    root = tmp_path_factory.mktemp("factory")
    torch.save(model.state_dict(), root / "weights.pt")
    (root / "kwargs.json").write_text(json.dumps(USER_KWARGS))
    out = root / "converted"
    argv = ["convert", str(root / "weights.pt"), "--model", "ckpt_user_models:build",
            "--config", str(root / "kwargs.json"), "--example-shape", "1,48,8", "--level", "2",
            "--seed", "7", "--out", str(out)]
    assert main(argv) == 0
    example = torch.randn(1, 48, 8, generator=torch.Generator().manual_seed(7))
    in_memory = ttt2la.convert(model, level=2, example_inputs=(example,))
    return in_memory, out


def test_factory_checkpoint_round_trip_is_exact(factory_checkpoint):
    in_memory, out = factory_checkpoint
    loaded = ttt2la.load(out, factory="ckpt_user_models:build")     # the recorded kwargs
    gen = torch.Generator().manual_seed(8)
    assert_same_outputs(in_memory, loaded, [torch.randn(2, 70, 8, generator=gen),
                                            torch.randn(1, 16, 8, generator=gen)])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["recipe"]["factory"] == "ckpt_user_models:build"
    assert manifest["example_inputs"] == {"kind": "normal", "shape": [1, 48, 8],
                                          "dtype": "float32", "seed": 7}
    assert manifest["source"]["path"].endswith("weights.pt")
    assert len(manifest["source"]["sha256"]) == 64


def test_a_bundled_model_by_name(tmp_path, capsys):
    """``ttt2la convert NAME`` works as ``--zoo NAME`` did; its checkpoint records the name."""
    from ttt2la.cli import ZOO, build_zoo_model

    out = tmp_path / "per-token"
    assert main(["convert", "per-token", "--level", "0", "--length", "8", "--out", str(out)]) == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["recipe"] == {"kind": "zoo", "name": "per-token"}
    loaded = ttt2la.load(out)
    x = ZOO["per-token"].example_inputs(2, 12, seed=3)[0]
    in_memory = ttt2la.convert(build_zoo_model("per-token"), level=0,
                               example_inputs=ZOO["per-token"].example_inputs(1, 8))
    assert_same_outputs(in_memory, loaded, [x])


def test_a_converted_checkpoint_converts_again(factory_checkpoint, tmp_path, capsys):
    """A converted directory is itself a checkpoint: its recipe builds the model (a factory
    other than a bundled model's once the caller trusts it)."""
    _in_memory, out = factory_checkpoint
    assert main(["inspect", str(out), "--example-shape", "1,32,8", "--trust-factory"]) == 0
    assert "1 TTT layer found" in capsys.readouterr().out


def test_a_converted_checkpoint_converts_again_on_its_recorded_inputs(user_package,
                                                                        factory_checkpoint,
                                                                        tmp_path):
    """Converted again without example flags, a directory reuses the example inputs it records
    (this model has no embedding, so none could be guessed): the result is the model converted
    in memory at the new level on those inputs."""
    import ckpt_user_models

    _in_memory, out = factory_checkpoint
    again = tmp_path / "level1"
    assert main(["convert", str(out), "--level", "1", "--model", "ckpt_user_models:build",
                 "--out", str(again)]) == 0          # the factory's kwargs: the recorded ones
    manifest = json.loads((again / MANIFEST_NAME).read_text())
    assert manifest["example_inputs"] == json.loads((out / MANIFEST_NAME).read_text())[
        "example_inputs"]
    assert manifest["level"] == 1
    model = ttt2la.load(out, trust_factory=True).eval()
    torch.manual_seed(5)
    source = ckpt_user_models.build(**USER_KWARGS).eval()
    source.load_state_dict(model.state_dict())
    example = torch.randn(1, 48, 8, generator=torch.Generator().manual_seed(7))
    in_memory = ttt2la.convert(source, level=1, example_inputs=(example,))
    gen = torch.Generator().manual_seed(9)
    assert_same_outputs(in_memory, ttt2la.load(again, trust_factory=True),
                        [torch.randn(2, 40, 8, generator=gen)])


# -- a Hugging Face directory ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_classes():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install 'ttt2la[hf]')")

    class TinyTTTConfig(transformers.PretrainedConfig):
        model_type = "ttt2la-test-tiny-lact"

        def __init__(self, vocab_size=64, d_model=32, n_layers=1, num_heads=2, chunk_size=16,
                     **kwargs):
            self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
            self.num_heads, self.chunk_size = num_heads, chunk_size
            super().__init__(**kwargs)

    class TinyTTTForCausalLM(transformers.PreTrainedModel):
        config_class = TinyTTTConfig

        def __init__(self, config):
            super().__init__(config)
            self.lm = TinyLaCTLM(config.vocab_size, config.d_model, config.n_layers,
                                 config.num_heads, config.chunk_size, tie_embeddings=False,
                                 muon=False)
            self.post_init()

        def forward(self, input_ids):
            return self.lm(input_ids)

    transformers.AutoConfig.register(TinyTTTConfig.model_type, TinyTTTConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(TinyTTTConfig, TinyTTTForCausalLM, exist_ok=True)
    return transformers, TinyTTTConfig, TinyTTTForCausalLM


@pytest.fixture(scope="module")
def hf_checkpoint(hf_classes, tmp_path_factory):
    """A sharded HF directory converted by ``ttt2la convert DIR --out``, and in memory."""
    transformers, config_cls, model_cls = hf_classes
    torch.manual_seed(9)
    model = model_cls(config_cls()).eval()
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "source", max_shard_size="20KB")
    assert (root / "source" / "model.safetensors.index.json").is_file()
    out = root / "converted"
    example = token_ids(1, 64, seed=11)
    save_file({"0": example}, str(root / "ids.safetensors"))
    assert main(["convert", str(root / "source"), "--level", "1", "--example-inputs",
                 str(root / "ids.safetensors"), "--out", str(out)]) == 0
    in_memory = ttt2la.convert(model, level=1, example_inputs=(example,))
    return transformers, model, in_memory, out


def test_hf_directory_round_trip_is_exact(hf_checkpoint):
    _transformers, _model, in_memory, out = hf_checkpoint
    loaded = ttt2la.load(out)
    assert_same_outputs(in_memory, loaded, [token_ids(2, 90, seed=10)])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["recipe"]["kind"] == "hf"
    assert manifest["recipe"]["auto_class"] == "AutoModelForCausalLM"
    assert manifest["example_inputs"]["kind"] == "file"      # the tensors kept beside the weights
    assert (out / manifest["example_inputs"]["file"]).is_file()
    assert len(manifest["source"]["files"]) > 1          # every shard hashed


def test_a_converted_hf_directory_converts_again_on_its_stored_inputs(hf_checkpoint, tmp_path):
    """The example tensors kept beside the weights serve again, and are kept again."""
    _transformers, model, _in_memory, out = hf_checkpoint
    again = tmp_path / "level2"
    assert main(["convert", str(out), "--level", "2", "--out", str(again)]) == 0
    manifest = json.loads((again / MANIFEST_NAME).read_text())
    assert manifest["example_inputs"]["kind"] == "file"
    stored = (again / manifest["example_inputs"]["file"]).read_bytes()
    assert stored == (out / manifest["example_inputs"]["file"]).read_bytes()
    in_memory = ttt2la.convert(model, level=2, example_inputs=(token_ids(1, 64, seed=11),))
    assert_same_outputs(in_memory, ttt2la.load(again), [token_ids(2, 90, seed=10)])


def test_converted_hf_directory_is_again_a_hf_directory(hf_checkpoint):
    transformers, model, _in_memory, out = hf_checkpoint
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert set(again.state_dict()) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_lossy_levels_record_their_folds_in_the_manifest(lm_checkpoints):
    """Levels 3-6 fold constants; the manifest carries them and loading replays them exactly
    (the round-trip test above), with no calibration data."""
    _model, out = lm_checkpoints
    converted, directory, loaded = out[MAX_LEVEL]
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    folded = [p for layer in converted.ttt2la_report.layers for p in layer.passes if p.folded]
    assert {p.name for p in folded} >= {"collapse_mlp", "absorb_lr", "remove_momentum"}
    text = json.dumps(manifest)
    for p in folded:
        assert p.name in text
    assert [p.folded for layer in loaded.ttt2la_report.layers for p in layer.passes] == \
        [p.folded for layer in converted.ttt2la_report.layers for p in layer.passes]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_outputs_get_the_modes_the_umask_gives(tmp_path, umask):
    """A checkpoint directory (and the files written into it, whatever their writer's own mode)
    and a report file get the modes a plain write would under the umask, not the owner-only
    ones of their temporary names."""
    import os
    import stat

    from ttt2la.checkpoint.writing import atomic_directory, atomic_file

    old = os.umask(umask)
    try:
        with atomic_directory(tmp_path / "out") as tmp:
            fd = os.open(tmp / "weights", os.O_WRONLY | os.O_CREAT, 0o600)   # as safetensors
            os.close(fd)
        with atomic_file(tmp_path / "r.json") as tmp:
            tmp.write_text("{}")
    finally:
        os.umask(old)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)
    assert mode(tmp_path / "out") == 0o777 & ~umask
    assert mode(tmp_path / "out" / "weights") == 0o666 & ~umask
    assert mode(tmp_path / "r.json") == 0o666 & ~umask
