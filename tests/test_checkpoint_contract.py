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
