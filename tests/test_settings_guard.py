"""A branch on one of torch's global settings — deterministic algorithms, the default dtype,
inference mode, autocast, a ``torch.backends`` flag, the matmul precision — taken after the
setting changed since conversion: the converted layer computes the original's new branch (an
exact conversion runs the code as written and says so) or refuses naming the line (a lossy
one); never the traced branch's output."""
import contextlib

import pytest
import torch

import ttt2la
from ttt2la.errors import ChangedAttributeError
from ttt2la.testing import rel_rms_error

from closing_memory import D, ClosingMemory



class Deterministic(ClosingMemory):
    def close(self, o, x):
        return o * 2 if torch.are_deterministic_algorithms_enabled() else o + 1


class DefaultDtype(ClosingMemory):
    def close(self, o, x):
        return o * 2 if torch.get_default_dtype() == torch.float32 else o + 1


class Inference(ClosingMemory):
    def close(self, o, x):
        return o * 2 if torch.is_inference_mode_enabled() else o + 1


class Mkldnn(ClosingMemory):
    def close(self, o, x):
        return o * 2 if torch.backends.mkldnn.enabled else o + 1


class Precision(ClosingMemory):
    def close(self, o, x):
        return o * 2 if torch.get_float32_matmul_precision() == "highest" else o + 1


def _finished(o):
    return o * 2 if torch.get_default_dtype() == torch.float32 else o + 1


class HelperDefaultDtype(ClosingMemory):
    def close(self, o, x):
        return _finished(o)


class Autocast(ClosingMemory):
    def close(self, o, x):
        return o + 1 if torch.is_autocast_enabled("cpu") else o * 2


@contextlib.contextmanager
def _setting(on, off):
    on()
    try:
        yield
    finally:
        off()


SETTINGS = {
    "deterministic": (Deterministic, lambda: _setting(
        lambda: torch.use_deterministic_algorithms(True),
        lambda: torch.use_deterministic_algorithms(False)), "are_deterministic"),
    "default dtype": (DefaultDtype, lambda: _setting(
        lambda: torch.set_default_dtype(torch.float64),
        lambda: torch.set_default_dtype(torch.float32)), "get_default_dtype"),
    "default dtype in a helper": (HelperDefaultDtype, lambda: _setting(
        lambda: torch.set_default_dtype(torch.float64),
        lambda: torch.set_default_dtype(torch.float32)), "get_default_dtype"),
    "inference mode": (Inference, torch.inference_mode, "is_inference_mode_enabled"),
    "backends flag": (Mkldnn, lambda: _setting(
        lambda: setattr(torch.backends.mkldnn, "enabled", False),
        lambda: setattr(torch.backends.mkldnn, "enabled", True)), "mkldnn.enabled"),
    "matmul precision": (Precision, lambda: _setting(
        lambda: torch.set_float32_matmul_precision("high"),
        lambda: torch.set_float32_matmul_precision("highest")), "float32_matmul_precision"),
    "autocast": (Autocast, lambda: _setting(lambda: torch.set_autocast_enabled("cpu", True),
                                            lambda: torch.set_autocast_enabled("cpu", False)),
                 "autocast"),
}


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_a_changed_setting_runs_the_new_branch(kind):
    make, changed, name = SETTINGS[kind]
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    x = torch.randn(2, 20, D)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5
    with changed():
        got, want = conv(x), layer(x)
    assert got.dtype == want.dtype
    assert rel_rms_error(got.float(), want.float()) <= 1e-5, kind
    runs = conv.ttt2la_report.layers[0].runs
    assert any(name in v and v.startswith("as written") for v in runs.values()), runs
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_a_lossy_conversion_refuses_naming_the_line(kind):
    make, changed, name = SETTINGS[kind]
    torch.manual_seed(0)
    conv = ttt2la.convert(make(), level=5, example_inputs=(torch.randn(2, 16, D),))
    assert conv._ttt2la.as_written is None          # lossy
    x = torch.randn(2, 20, D)
    conv(x)
    with changed(), pytest.raises(ChangedAttributeError, match=rf"{__file__}:\d+"):
        conv(x)
    conv(x)


def test_a_layer_that_reads_no_setting_keeps_no_guard():
    class Plain(ClosingMemory):
        def close(self, o, x):
            return o * 2

    conv = ttt2la.convert(Plain(), level=0, example_inputs=(torch.randn(2, 16, D),))
    assert conv._ttt2la.settings is None
