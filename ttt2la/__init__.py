"""ttt2la: turn test-time-training layers into chunk-parallel linear attention.

    converted = ttt2la.convert(model, level=2, example_inputs=(x,))
    print(converted.ttt2la_report)
    ttt2la.inspect(model, example_inputs=(x,))
    print(ttt2la.sweep(model, calibration=(x,)).to_markdown())
    ttt2la.save(converted, "out/", example_inputs=(x,), factory="pkg.mod:build")
    again = ttt2la.load("out/")
"""
from .interrupt_at_launch import quiet_until_main as _quiet_until_main

_quiet_until_main()

from .as_written import race_as_written  # noqa: E402
from .checkpoint import load, save
from .checkpoint.errors import (CheckpointError, ManifestError, UnsafeCheckpointError,
                                WeightMismatchError)
from .conversion import convert, inspect
from .folded_weights import FoldsFromOtherWeightsWarning
from .frontend.trace_cache import clear_caches
from .errors import (AlreadyConvertedError, ChangedAttributeError, CompileError, ConversionError,
                     LaggedStateError, LevelNotImplementedError, NonReducibleError,
                     PartialChunkError,
                     PlanFallbackError, RejectedCallError, SideEffectError, StreamingError,
                     UnsupportedExportError, UnsupportedShapeError, UnsupportedTTTError)
from .report import ConversionReport, InspectionReport
from .stream import Stream, TTTState
from .sweep import SweepReport, sweep
from .validation import InvalidInputError

__version__ = "0.1.0"

__all__ = ["convert", "inspect", "clear_caches", "save", "load", "ConversionError", "InvalidInputError",
           "CheckpointError", "UnsafeCheckpointError", "WeightMismatchError", "ManifestError",
           "NonReducibleError", "UnsupportedTTTError",
           "UnsupportedShapeError", "LevelNotImplementedError", "PlanFallbackError", "PartialChunkError",
           "ChangedAttributeError", "SideEffectError", "LaggedStateError",
           "ConversionReport",
           "InspectionReport", "SweepReport", "sweep", "Stream", "TTTState", "StreamingError",
           "AlreadyConvertedError", "CompileError", "RejectedCallError", "UnsupportedExportError",
           "FoldsFromOtherWeightsWarning", "race_as_written", "__version__"]
