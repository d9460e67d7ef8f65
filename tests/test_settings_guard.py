"""A branch on one of torch's global settings — deterministic algorithms, the default dtype,
inference mode, autocast, a ``torch.backends`` flag, the matmul precision — taken after the
setting changed since conversion: the converted layer computes the original's new branch (an
exact conversion runs the code as written and says so) or refuses naming the line (a lossy
one); never the traced branch's output. The readers are spelled as torch names them and under
other names (``alias:``: imported as, a global, a default, a closure's cell, the layer's
attribute or an object's it holds), read in a helper the layer calls or holds (``held:``)."""
import contextlib
import types

import pytest
import torch
import torch.backends.mkldnn as mk
from torch import are_deterministic_algorithms_enabled as det
from torch import get_default_dtype as gdd
from torch.backends.cuda import matmul as mm

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


# The same readers under other names: the guard finds them by the object the name holds.
READ_DTYPE = torch.get_default_dtype


class DefaultDtypeImportedAs(ClosingMemory):
    def close(self, o, x):
        return o * 2 if gdd() == torch.float32 else o + 1


class DefaultDtypeOfAGlobal(ClosingMemory):
    def close(self, o, x):
        return o * 2 if READ_DTYPE() == torch.float32 else o + 1


class DeterministicImportedAs(ClosingMemory):
    def close(self, o, x):
        return o * 2 if det() else o + 1


class MkldnnImportedAs(ClosingMemory):
    def close(self, o, x):
        return o * 2 if mk.enabled else o + 1


class MatmulImportedAs(ClosingMemory):
    def close(self, o, x):
        return o * 2 if mm.allow_tf32 else o + 1


class DefaultDtypeAsADefault(ClosingMemory):
    def close(self, o, x, read=torch.get_default_dtype):
        return o * 2 if read() == torch.float32 else o + 1


def _closing_over(read):
    class DefaultDtypeInAClosure(ClosingMemory):
        def close(self, o, x):
            return o * 2 if read() == torch.float32 else o + 1
    return DefaultDtypeInAClosure


class HeldReader(ClosingMemory):
    """Reads the setting through a reader it is given, which its code names by no global."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def close(self, o, x):
        return o * 2 if self.read() == torch.float32 else o + 1


class HeldSettings(ClosingMemory):
    """Reads the setting through an object of settings it is given (``self.cfg.read()``)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def close(self, o, x):
        return o * 2 if self.cfg.read() == torch.float32 else o + 1


class HeldHelper(ClosingMemory):
    """Finished by a helper it is given, which its code names by no global."""

    def __init__(self, finish):
        super().__init__()
        self.finish = finish

    def close(self, o, x):
        return self.finish(o)


class Helpers:
    @staticmethod
    def finished(o):
        return o * 2 if torch.get_default_dtype() == torch.float32 else o + 1


class DefaultDtypeInAStaticMethod(ClosingMemory):
    def close(self, o, x):
        return Helpers.finished(o)


@contextlib.contextmanager
def _setting(on, off):
    on()
    try:
        yield
    finally:
        off()


def _float64():
    return _setting(lambda: torch.set_default_dtype(torch.float64),
                    lambda: torch.set_default_dtype(torch.float32))


def _deterministic():
    return _setting(lambda: torch.use_deterministic_algorithms(True),
                    lambda: torch.use_deterministic_algorithms(False))


def _no_mkldnn():
    return _setting(lambda: setattr(torch.backends.mkldnn, "enabled", False),
                    lambda: setattr(torch.backends.mkldnn, "enabled", True))


def _tf32():
    return _setting(lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
                    lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False))


SETTINGS = {
    "deterministic": (Deterministic, _deterministic, "are_deterministic"),
    "default dtype": (DefaultDtype, _float64, "get_default_dtype"),
    "default dtype in a helper": (HelperDefaultDtype, _float64, "get_default_dtype"),
    "alias: default dtype imported as": (DefaultDtypeImportedAs, _float64, "get_default_dtype"),
    "alias: default dtype of a global": (DefaultDtypeOfAGlobal, _float64, "get_default_dtype"),
    "alias: default dtype as a default": (DefaultDtypeAsADefault, _float64, "get_default_dtype"),
    "alias: default dtype in a closure": (lambda: _closing_over(torch.get_default_dtype)(),
                                          _float64, "get_default_dtype"),
    "alias: default dtype the layer holds": (lambda: HeldReader(torch.get_default_dtype),
                                             _float64, "get_default_dtype"),
    "alias: default dtype in an object the layer holds": (
        lambda: HeldSettings(types.SimpleNamespace(read=torch.get_default_dtype)), _float64,
        "get_default_dtype"),
    "alias: deterministic imported as": (DeterministicImportedAs, _deterministic,
                                         "are_deterministic"),
    "alias: backends flag of a module imported as": (MkldnnImportedAs, _no_mkldnn,
                                                     "mkldnn.enabled"),
    "alias: backends flag of an object imported as": (MatmulImportedAs, _tf32, "allow_tf32"),
    "held: default dtype in a helper the layer holds": (lambda: HeldHelper(_finished),
                                                        _float64, "get_default_dtype"),
    "held: default dtype in a static method": (DefaultDtypeInAStaticMethod, _float64,
                                               "get_default_dtype"),
    "inference mode": (Inference, torch.inference_mode, "is_inference_mode_enabled"),
    "backends flag": (Mkldnn, _no_mkldnn, "mkldnn.enabled"),
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
