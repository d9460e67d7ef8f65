"""Every Python source of the package, its benchmarks and its tests compiles without a warning: an invalid
escape in a docstring is a SyntaxWarning printed at every import on Python 3.12, and an error in a later
release."""
from __future__ import annotations

import pathlib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("ttt2la", "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py"))


def test_there_are_sources_to_check():
    assert len(SOURCES) > 100 and any(p.name == "conversion.py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compiles_without_warnings(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
