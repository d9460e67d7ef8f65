"""Values of the call's sizes that NumPy, text or CPython's plain numbers would make untracked
(``size_numpy``, ``size_text``, ``size_conversions``, ``size_operands``, ``size_order``), found by the run of ``size_uses``: each
spelling's value is a use of the length where it changes with the length (a decision) or is no
affine function of it (a number passed to torch), and none where it is not — tracked, not
flagged wholesale; a spelling no tracked number can follow (``np.float64(T)``, text) is a use
wherever its value changes. A decision every run must find (``T % 8``) shows the run went
through: a run that fails finds nothing."""
import copy
import functools
import math
import operator
from operator import mul
import sys

import numpy as np
import pytest
import torch

from ttt2la.frontend.size_uses import size_uses

from shape_checks import loop_line

D = 4
EVERY_RUN = "o = o * (1 + T % 8)"

def _scaled_in_place(T):
    c = 0.5
    c *= T
    return c


def _length_of(T):
    return T


class _Counted:
    """A callable of the user's that returns 3 and counts its calls."""

    calls = 0

    def __call__(self, v):
        _Counted.calls += 1
        return 3


def _scaled_by_a_made_objects_method(T):
    return 0.5 * _Holder(T).length()


def _scaled_by_a_made_objects_method_of_a_constant(T):
    return 0.5 * _Holder(T * 0 + 3).length()


def _scaled_by_a_local_abs(T):
    abs = _Counted()        # noqa: A001 - the user's own ``abs``: never called by the watch
    return 0.5 * abs(T)


def _second(a, b):
    return b


class _Holder:
    def __init__(self, T):
        self.T = T

    def length(self):
        return self.T

    def __call__(self):
        return self.T


class _Touchy:
    """A callable whose instances fail on any attribute they lack."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name}")

    def __call__(self, T):
        return T


def _scaled_by_a_touchy_object(T):
    touchy = _Touchy()
    return 0.5 * touchy(T)


def _scaled_by_method(T):
    holder = _Holder(T)
    return 0.5 * holder.length()


def _compared_with_a_call_object(T):
    holder = _Holder(T)
    return 20.5 < holder()


def _sorted_in_place(T, low: float, i: int):
    xs = [T, low]
    xs.sort()
    return xs[i]


#: (value of the length multiplied into the output, is it a use?)
NUMBERS = {
    "np.sqrt": (lambda T: np.sqrt(T), True),
    "np.log2": (lambda T: np.log2(T), True),
    "np.ceil": (lambda T: np.ceil(T / 4), False),
    "np.floor": (lambda T: np.floor(T / 4), False),
    "np.round": (lambda T: np.round(T / 4), False),
    "np.round of a third": (lambda T: np.round(T / 3), True),
    "np.maximum": (lambda T: np.maximum(T, 64), True),
    "np.maximum below": (lambda T: np.maximum(T, 4), False),
    "np.minimum": (lambda T: np.minimum(T, 64), True),
    "np.clip": (lambda T: np.clip(T, 8, 64), True),
    "np.clip open": (lambda T: np.clip(T, 0, None), False),
    "NumPy scalar times": (lambda T: np.float64(0.5) * T, False),
    "plus a NumPy int": (lambda T: T + np.int64(3), False),
    "np.float64 of it": (lambda T: np.float64(T), True),
    # a NumPy scalar's own method: the code runs again as written, NumPy's values plain
    "NumPy method": (lambda T: np.sqrt(T * T).astype(np.float64), True),
    "int": (lambda T: int(T / 4), False),
    "float": (lambda T: float(T), False),
    # torch takes no other ``float`` for a dtype: the code runs again as written, where
    # ``float(T)`` is a plain copy
    "float where torch is given dtype=float": (
        lambda T: float(T) * torch.ones(1, dtype=float).item(), True),
    "operator.index": (lambda T: operator.index(T), False),
    "numerator": (lambda T: T.numerator, False),
    "real": (lambda T: T.real, False),
    "conjugate": (lambda T: T.conjugate(), False),
    "bit_length": (lambda T: T.bit_length(), True),
    "as_integer_ratio": (lambda T: (T / 4).as_integer_ratio()[0], False),
    "round to digits": (lambda T: round(T / 4, 1), False),
    "pow with a modulus": (lambda T: pow(T, 2, 7), True),
    "pow with a large modulus": (lambda T: pow(T, 1, 1 << 40), False),
    "math.prod": (lambda T: math.prod([T, 2]), False),
    "deepcopy": (lambda T: copy.deepcopy({"T": T})["T"], False),
    # a plain float on the left makes a plain number: conservatively a use wherever it changes
    "a float on the left": (lambda T: 0.5 * T, True),
    "a float multiplied in place": (_scaled_in_place, True),
    # ... also where the length is what a call of the user's returned
    "a float times a helper's value": (lambda T: 0.5 * _length_of(T), True),
    "a float times a method's value": (_scaled_by_method, True),
    "a float times a call object's value, its attributes failing": (
        _scaled_by_a_touchy_object, True),
    "a float times a helper's value and a constant": (lambda T: 0.5 * _length_of(T * 0), False),
    # the frames a builtin starts are not the call's: ``reduce`` returns the last 0 here
    "a float times a builtin's value, a helper called inside it": (
        lambda T: 0.5 * functools.reduce(_second, [0, T, 0]), False),
    "a float times the values of two helpers": (
        lambda T: 0.5 * (_length_of(T) + _length_of(3)), True),
    # ... and where it is what a builtin of numbers returned: called in the frame
    "a float times abs of it": (lambda T: 0.5 * abs(T), True),
    "a float times pow of it": (lambda T: 0.5 * pow(T, 2), True),
    "a float times round of it": (lambda T: 0.5 * round(T / 3), True),
    "a float times int of it": (lambda T: 0.5 * int(T), True),
    "a float times divmod's remainder": (lambda T: 0.5 * divmod(T, 7)[1], True),
    "a float times abs of a helper's value": (lambda T: 0.5 * abs(_length_of(T)), True),
    "a float times abs of a constant": (lambda T: 0.5 * abs(T * 0 - 3), False),
    "a float times a sum with it": (lambda T: 0.5 * sum([T, 1]), True),
    # ... or the branch a conditional expression or ``and``/``or`` takes
    "a float times a conditional of it": (lambda T: 0.5 * (T if T > 0 else 1), True),
    "a float times a conditional of a constant": (lambda T: 0.5 * (3 if T > 0 else 1), False),
    "a float times an or of it": (lambda T: 0.5 * (T or 1), True),
    "a float times an and of it": (lambda T: 0.5 * (T > 0 and T), True),
    "a float times an item of a dict display": (lambda T: 0.5 * {0: T, 1: 2}[0], True),
    "a float times a constant item of a dict display": (lambda T: 0.5 * {0: T, 1: 2}[1], False),
    # ... and, conservatively, an operand it cannot follow that names a value of the length
    "a float times an item of a comprehension of it": (lambda T: 0.5 * [n for n in (T,)][0],
                                                       True),
    "a float times a sum of a generator over its range": (
        lambda T: 0.5 * sum(1 for _ in range(T)), True),
    "a float times an item of a comprehension of a constant": (
        lambda T: 0.5 * [n for n in (3,)][0], False),
    # ... or what a function of the ``operator`` module returned, however it is named
    "a float times operator.mul of it": (lambda T: 0.5 * operator.mul(T, 2), True),
    "a float times mul of it, imported by name": (lambda T: 0.5 * mul(T, 2), True),
    "a float times operator.mod of it": (lambda T: 0.5 * operator.mod(T, 8), True),
    "a float times operator.mul of a constant": (lambda T: 0.5 * operator.mul(T * 0 + 3, 2),
                                                 False),
    "a float times what a local named abs returns": (_scaled_by_a_local_abs, False),
    # ... and where it is what a method of a call's result returned
    "a float times the method of a made object": (_scaled_by_a_made_objects_method, True),
    "a float times the method of a made object of a constant": (
        _scaled_by_a_made_objects_method_of_a_constant, False),
    # the order of a value of the length among plain floats (``size_order``)
    "min with a float": (lambda T: min(T, 40.5), True),
    "max with a float": (lambda T: max(T, 40.5), True),
    "min of a list with a float": (lambda T: min([T, 40.5]), True),
    "max with a float below every length": (lambda T: max(T, 0.5), False),
    "sorted with a float": (lambda T: sorted([T, 30.5])[0], True),
    "sorted with a float below every length": (lambda T: sorted([T, 0.5])[1], False),
    # ... compared by a key: the item picked or the order is the decision
    "min with a float and a key": (lambda T: min(T, 40.5, key=lambda v: v), True),
    "max of a list with a float and a key": (lambda T: max([T, 40.5], key=lambda v: -v), True),
    "max with a float below every length and a key": (
        lambda T: max(T, 0.5, key=lambda v: v), False),
    "sorted with a float and a key": (lambda T: sorted([T, 30.5], key=lambda v: -v)[0], True),
    "sorted with a float below every length and a key": (
        lambda T: sorted([T, 0.5], key=lambda v: v)[1], False),
    # ... and sorted in place (``size_operands``)
    "sorted in place with a float": (lambda T: _sorted_in_place(T, 30.5, 0), True),
    "sorted in place with a float below every length": (
        lambda T: _sorted_in_place(T, 0.5, 1), False),
}

#: (value of the length the output branches on, is it a use?)
DECISIONS = {
    "f-string": (lambda T: f"{T}".endswith("6"), True),
    "format spec": (lambda T: f"{T:04d}" < "0017", True),
    "str": (lambda T: str(T) in ("16", "24"), True),
    "repr": (lambda T: repr(T)[-1] == "6", True),
    "str.format": (lambda T: "{}".format(T) == "16", True),
    "hex": (lambda T: hex(T).endswith("0"), True),
    "to_bytes": (lambda T: T.to_bytes(4, "little")[0] == 16, True),
    "text of a constant": (lambda T: f"{T * 0}" == "0", False),
    "bit_length": (lambda T: (T % 8).bit_length(), True),
    "int": (lambda T: int(T) % 8, True),
    "operator.index": (lambda T: operator.index(T) % 8, True),
    "numerator": (lambda T: T.numerator % 8, True),
    "is_integer": (lambda T: (T / 8).is_integer(), True),
    "pow with a modulus": (lambda T: pow(T, 1, 8), True),
    "divmod": (lambda T: divmod(T, 8)[1], True),
    "sorted": (lambda T: sorted([T % 8, 8])[0], True),
    "np.sqrt": (lambda T: np.sqrt(T) % 1, True),
    "np.isclose": (lambda T: not np.isclose(T % 8, 0), True),
    "NumPy array": (lambda T: not (np.arange(8) == T % 8)[0], True),
    "np.array of it": (lambda T: np.array(T) % 8, True),
    "np.mean": (lambda T: np.mean([T, 0]) % 4, True),
    "NumPy constant": (lambda T: np.maximum(T, 4) >= 4, False),
    # CPython reads the value without asking it (``size_operands``)
    "a float on the left": (lambda T: (0.5 * T) % 4 < 2, True),
    "a float on the left of a constant": (lambda T: 0.5 * (T * 0) == 0, False),
    "a float compared": (lambda T: 20.5 < T, True),
    "a float compared in a chain": (lambda T: 0 < 20.5 < T, True),
    "a float compared with a helper's value": (lambda T: 20.5 < _length_of(T), True),
    "a float compared with a call object's value": (_compared_with_a_call_object, True),
    "an index into a list by a helper's value": (
        lambda T: [3.0, 2.0, 1.0, 0.0][_length_of(T) % 4], True),
    "in a list of floats": (lambda T: T in [16.0, 24.0, 32.0], True),
    "in a list of ints": (lambda T: T in [16, 24, 32], True),
    "an index into a list": (lambda T: [3.0, 2.0, 1.0, 0.0][T % 4], True),
    "an index into a tuple of equal items": (lambda T: (1.0, 1.0)[T % 2], False),
    "a slice of text": (lambda T: "abcdefgh"[:T % 8] == "abcd", True),
    "% formatting": (lambda T: ("%d" % T).endswith("6"), True),
    "% formatting of a tuple": (lambda T: "%d-%d" % (T, 1) < "17", True),
}


def _needs_positions(name: str) -> None:
    """A call's value is read by the caller's position in its line, which Python 3.11 gives."""
    if sys.version_info < (3, 11) and any(w in name for w in (
            "helper", "method", "object", "builtin")):
        pytest.skip("an operand spelled as a call is read on Python 3.11 and later")


def multiplied(x, value):
    B, T, _ = x.shape
    o = x
    for s in range(0, T, 4):
        o = o + 1
    o = o * (1 + T % 8)
    return o * value(T)


def branched(x, value):
    B, T, _ = x.shape
    o = x
    for s in range(0, T, 4):
        o = o + 1
    o = o * (1 + T % 8)
    return o * 2 if value(T) else o


def printed(x, value):
    B, T, _ = x.shape
    o = x
    for s in range(0, T, 4):
        o = o + 1
    o = o * (1 + T % 8)
    print(f"length {T}", end="")
    key = f"mask_{T}"
    return o * len(key)


def found(fn, value=None, L: int = 20, B: int = 3) -> list[str]:
    """The code of each line whose use of the length the run finds, the line every run must
    find (``T % 8``) first where it is found."""
    x = torch.randn(B, L, D)
    out = size_uses(lambda: fn(x, value), L, B, 4, 1, (__file__, loop_line(fn)))
    codes = [v.code for v in out if v.of == "the length"]
    return sorted(codes, key=lambda code: code != EVERY_RUN)


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_a_number_of_the_length_is_a_use_where_it_is_not_affine(name):
    _needs_positions(name)
    value, use = NUMBERS[name]
    codes = found(multiplied, value)
    assert codes[:1] == [EVERY_RUN], codes
    assert (len(codes) > 1) == use, codes


def test_a_name_of_a_builtin_bound_to_the_users_code_is_not_called_to_read_it():
    """``abs`` bound in the frame to the user's callable: read by name, it would be the user's
    code run again; the run calls it once, as the code does."""
    before = _Counted.calls
    codes = found(multiplied, _scaled_by_a_local_abs)
    assert codes == [EVERY_RUN]
    assert _Counted.calls - before == 1


@pytest.mark.parametrize("name", sorted(DECISIONS))
def test_a_decision_on_the_length_is_a_use_where_it_changes(name):
    _needs_positions(name)
    value, use = DECISIONS[name]
    codes = found(branched, value)
    assert codes[:1] == [EVERY_RUN], codes
    assert (len(codes) > 1) == use, codes


def test_text_only_printed_is_no_use():
    assert found(printed) == [EVERY_RUN, 'key = f"mask_{T}"']


def _line_tracer(seen: list, reset_on_call: bool = False):
    """A user's tracer (a debugger's, coverage's) recording the lines of ``branched`` it sees;
    ``reset_on_call``: it sets itself again on every call, as coverage's C tracer does."""
    def tracer(frame, event, arg):
        if reset_on_call and event == "call":
            sys.settrace(tracer)
        if frame.f_code is not branched.__code__:
            return None

        def local(frame, event, arg):
            seen.append((event, frame.f_lineno))
            return local
        return local
    return tracer


@pytest.mark.parametrize("reset_on_call", [False, True])
def test_a_tracer_set_already_runs_alongside_the_watch(reset_on_call):
    """A decision CPython makes without asking the length is found under a tracer set already,
    and that tracer sees the events it sees without the conversion's run, and is set again."""
    value = DECISIONS["a float compared"][0]
    alone, seen = [], []
    tracer = _line_tracer(alone, reset_on_call)
    sys.settrace(tracer)
    try:
        branched(torch.randn(3, 20, D), value)
    finally:
        sys.settrace(None)
    tracer = _line_tracer(seen, reset_on_call)
    sys.settrace(tracer)
    try:
        codes = found(branched, value)
        after = sys.gettrace()
    finally:
        sys.settrace(None)
    assert after is tracer
    assert len(codes) > 1, codes
    assert sorted(set(seen)) == sorted(set(alone)) and alone
