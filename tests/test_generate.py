"""``ttt2la generate``: sampling from a converted checkpoint with the fast weights carried across
tokens gives what the converted model gives when it re-reads the whole sequence every step."""
from __future__ import annotations

from importlib.resources import files

import pytest
import torch

import ttt2la
from ttt2la.cli import EXIT_BAD_INPUT, main
from ttt2la.generate import generate_text, sample_tokens
from ttt2la.zoo.trained import encode

WEIGHTS = files("ttt2la.zoo") / "weights"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The bundled trained character LM, converted at level 2 from the command line."""
    out = tmp_path_factory.mktemp("generate") / "char-lm"
    assert main(["convert", str(WEIGHTS / "char_lm.safetensors"), "--model",
                 "ttt2la.zoo:TinyLaCTLM", "--config", str(WEIGHTS / "char_lm.config.json"),
                 "--example-shape", "1,64", "--level", "2", "--out", str(out)]) == 0
    return out, ttt2la.load(out).eval()


def greedy_by_rereading(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding that runs the whole sequence through the model at every step."""
    ids = prompt.tolist()
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_sampling_with_carried_state_equals_rereading(checkpoint):
    _out, model = checkpoint
    prompt = encode("def __init__(self")
    n = 21                                  # crosses a 16-token chunk boundary of the layers
    assert list(sample_tokens(model, prompt, n, temperature=0)) == \
        greedy_by_rereading(model, prompt, n)


def test_sampling_is_seeded_and_text_decodes(checkpoint):
    _out, model = checkpoint
    a = generate_text(model, "import ", 30, temperature=0.8, seed=3)
    b = generate_text(model, "import ", 30, temperature=0.8, seed=3)
    assert a == b and isinstance(a, str) and len(a.encode("utf-8", "replace")) >= 20


def test_generate_command_prints_the_continuation(checkpoint, capsys):
    out, model = checkpoint
    assert main(["generate", str(out), "--prompt", "class ", "--tokens", "12",
                 "--temperature", "0"]) == 0
    expected = bytes(greedy_by_rereading(model, encode("class "), 12)).decode("utf-8",
                                                                             "replace")
    assert capsys.readouterr().out == "class " + expected + "\n"


def test_token_ids_outside_the_vocabulary_are_bad_input(checkpoint, capsys):
    out, _model = checkpoint
    assert main(["generate", str(out), "--prompt-ids", "3,999", "--tokens", "2"]) == \
        EXIT_BAD_INPUT
    assert "outside the model's vocabulary" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_a_temperature_that_is_not_a_finite_number_at_least_0(tmp_path, capsys, temperature):
    """Refused before the checkpoint is read (so none is needed here), not deep in sampling."""
    assert main(["generate", str(tmp_path), "--tokens", "2", "--temperature", temperature]) == \
        EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith("ttt2la generate: InvalidInputError: temperature must be a finite "
                          "number >= 0") and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def layer_checkpoint(tmp_path_factory):
    """A converted layer (features in, features out): no language model."""
    out = tmp_path_factory.mktemp("generate") / "layer"
    assert main(["convert", "--zoo", "lact-variant2", "--level", "2", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("prompt", [["--prompt-ids", "1,2"], ["--prompt", "hello"]])
def test_a_checkpoint_of_no_language_model_is_bad_input_and_nothing_is_printed(
        layer_checkpoint, capsys, prompt):
    assert main(["generate", str(layer_checkpoint), *prompt, "--tokens", "2"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""                       # the text prompt is not echoed first
    assert "no language model" in captured.err or "byte-level" in captured.err, captured.err
