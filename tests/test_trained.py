"""The committed character-level LM: it loads from safetensors, has learned something, and its
train/validation split of the standard library is by file and the same wherever the file is."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, strategies as st

from ttt2la.zoo import TinyLaCTLM
from ttt2la.zoo.trained import (WEIGHTS_DIR, decode, encode, load_card,
                                next_token_loss, split_stdlib, stdlib_sources, trained_char_lm,
                                unigram_loss, validation_sequences)


@pytest.fixture(scope="module")
def trained():
    return trained_char_lm()


def test_the_card_names_files_that_exist_and_a_factory_config():
    card = load_card()
    for key in ("weights", "config"):
        assert (WEIGHTS_DIR / card[key]).is_file()
    assert card["factory"] == "ttt2la.zoo:TinyLaCTLM"
    kwargs = json.loads((WEIGHTS_DIR / card["config"]).read_text())
    assert kwargs["vocab_size"] == card["vocabulary"]["size"] == 256
    assert card["training"]["sequence_length"] // kwargs["chunk_size"] >= 4
    # a few hundred thousand parameters, stored in at most a few MB
    assert 100_000 <= card["parameters"] <= 1_000_000
    assert (WEIGHTS_DIR / card["weights"]).stat().st_size <= 4 * 2**20


def test_committed_weights_load_into_the_named_model(trained):
    model = trained.model
    assert isinstance(model, TinyLaCTLM) and not model.training
    assert sum(p.numel() for p in model.parameters()) == trained.card["parameters"]
    assert model.lm_head.weight is model.embed.weight        # tied, as trained


def test_committed_model_beats_the_unigram_baseline_on_held_out_text(trained):
    rows = trained.validation_sequences(4)
    assert rows.shape == (4, trained.sequence_length + 1)
    loss = next_token_loss(trained.model, rows)
    baseline = unigram_loss(rows)
    # the best unigram model of this very text is beaten by a wide margin (> 0.5 nats/byte)
    assert math.isfinite(loss) and loss < baseline - 0.5, (loss, baseline)


def test_the_ttt_loop_carries_what_the_model_knows_of_earlier_chunks(trained):
    """With every per-token learning rate pushed to zero the fast weights never change, and the
    model, whose only token mixers are its LaCT layers, predicts held-out text worse."""
    import copy

    rows = trained.validation_sequences(4)
    frozen = copy.deepcopy(trained.model)
    for block in frozen.blocks:
        block.ttt.base_lr_inv = -1e4
    assert next_token_loss(trained.model, rows) < next_token_loss(frozen, rows) - 0.02


def test_unigram_loss_of_a_text_with_two_equally_frequent_bytes_is_log_2():
    rows = torch.tensor([[7, 65, 66, 65, 66]])        # targets: A B A B
    assert unigram_loss(rows) == pytest.approx(math.log(2))


def test_next_token_loss_of_a_model_that_knows_the_next_byte_is_near_zero():
    rows = torch.tensor([[1, 2, 3, 4, 5], [9, 10, 11, 12, 13]])

    def successor(ids):                               # puts all its mass on id + 1
        return torch.nn.functional.one_hot(ids + 1, 256).float() * 100.0
    assert next_token_loss(successor, rows) < 1e-6
    uniform = next_token_loss(lambda ids: torch.zeros(*ids.shape, 256), rows)
    assert uniform == pytest.approx(math.log(256))


@given(st.text(max_size=50))
def test_encode_gives_utf8_bytes_and_decode_inverts_it(text):
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text


def _fake_stdlib(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")


def test_split_is_by_file_disjoint_complete_and_leaves_site_packages_out(tmp_path):
    names = [f"pkg{i % 7}/mod{i}.py" for i in range(200)] + ["site-packages/x/y.py"]
    _fake_stdlib(tmp_path, names)
    train, validation = split_stdlib(tmp_path)
    assert not set(train) & set(validation)
    assert sorted(train + validation) == sorted(n for n in names if "site-packages" not in n)
    assert train == sorted(train) and validation == sorted(validation)
    assert 5 <= len(validation) <= 40                  # about one file in ten, not none or all


def test_a_file_is_held_out_wherever_it_is_and_whatever_else_is_there(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _fake_stdlib(a, [f"m{i}.py" for i in range(100)])
    _fake_stdlib(b, [f"m{i}.py" for i in range(0, 100, 3)] + ["extra.py"])
    held_a = set(split_stdlib(a)[1])
    held_b = set(split_stdlib(b)[1])
    assert held_a & set(stdlib_sources(b)) == held_b - {"extra.py"}
    assert split_stdlib(a, seed=1) != split_stdlib(a, seed=0)


def test_validation_sequences_are_deterministic_and_come_from_held_out_files(tmp_path):
    _fake_stdlib(tmp_path, [f"m{i}.py" for i in range(300)])
    first = validation_sequences(3, 8, root=tmp_path)
    assert torch.equal(first, validation_sequences(3, 8, root=tmp_path))
    held = {f"# {name}\n" for name in split_stdlib(tmp_path)[1]}
    for row in first:
        text = bytes(row.tolist()).decode()
        assert any(piece in "\0".join(sorted(held)) for piece in text.split("\0") if piece)
    with pytest.raises(ValueError, match="held-out"):
        validation_sequences(10_000, 100, root=tmp_path)
