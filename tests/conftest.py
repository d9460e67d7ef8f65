"""Suite-wide setup: run ``torch.compile``-decorated code eagerly (fast on CPU) and register hypothesis profiles.

A test that needs compilation re-enables it locally with
``torch.compiler.set_stance("default")`` and ``torch._dynamo.config.patch(disable=False)``.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, see docs/testing.md):

* ``ci`` (the default): derandomized — every run draws the same examples, so the suite passes
  or fails deterministically, in CI and on a developer's machine alike;
* ``dev``: random draws with each test's own example counts, to look for new failures;
* ``wide``: random draws with five times each test's example count, for a long exploration.
"""
import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import module_scoped
import ttt2la
from ttt2la import race_as_written

# Under pytest-xdist each worker has a core of its own: one intra-op thread each, not oversubscribed.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Conversions trace thousands of small objects (fx nodes, fake tensors, pytree specs) that live
# until the conversion ends: at Python's default thresholds the collector scans them again and
# again while they are still in use. Collecting about seventy times less often ran a slice of
# the suite 5-15 % faster, at the same peak memory (about 1.5 GB a worker).
gc.set_threshold(50_000, 20, 100)

torch._dynamo.config.disable = True
# With dynamo disabled, a ``fullgraph=True`` function raises "found no compiled frames" unless the
# stance is eager, so both switches are needed for such code to run as plain Python.
torch.compiler.set_stance("force_eager")

#: How many times each test's own ``max_examples`` the ``wide`` profile draws.
WIDE_FACTOR = 5

settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "wide", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(items):
    """Under ``wide``, scale every hypothesis test's own example count by ``WIDE_FACTOR``.

    A test's ``@settings(max_examples=...)`` overrides the profile's, so the profile alone
    cannot widen the search; the count is scaled on the collected test instead.
    """
    if PROFILE != "wide":
        return
    for item in items:
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is not None:
            fn._hypothesis_internal_use_settings = settings(
                own, max_examples=own.max_examples * WIDE_FACTOR)


@pytest.fixture(autouse=True, scope="session")
def plans_alone():
    """Converted layers race their plan against the user's code on repeated calls without
    gradients (``ttt2la.as_written``); the suite tests plans, so they run alone unless a test
    turns the race on itself."""
    with race_as_written(False):
        yield


@pytest.fixture(scope="module")
def always_scan():
    """Delta-rule memories scanned at every size: modules that test the matrix-affine scan
    itself opt in (``pytestmark = pytest.mark.usefixtures("always_scan")``), where on a CPU the
    cost rule (``scan_pays``, tested as it stands) would loop over their few chunks instead."""
    from ttt2la.lowering.lift_delta import scanning

    with scanning(True):
        yield


@pytest.fixture(autouse=True, scope="module")
def settled_heap():
    """After each test module, its cached conversions (``module_scoped``) and ttt2la's kept
    recognitions and traces are let go and collected, and what is left alive is moved out of the
    garbage collector's sight: a worker runs dozens of modules, and every full collection would
    scan all they left, making each later conversion slower. Frozen objects are never collected,
    so what a module leaves must be let go before, or it stays for the whole session: fx gives
    each graph module a class of its own, and every trace costs time in proportion to the number
    of ``nn.Module`` subclasses alive (see ``module_scoped``)."""
    yield
    module_scoped.empty()
    ttt2la.clear_caches()
    gc.collect()
    gc.freeze()
