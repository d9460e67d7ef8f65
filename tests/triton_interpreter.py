"""Import the Triton kernel modules the way the kernel tests need them: for Triton's CPU interpreter when
there is no GPU.

Triton decides between compiling and interpreting a kernel when it is decorated, from ``TRITON_INTERPRET``,
so the first test module to import any kernel module (``_common`` included, which ``tile_tuning`` imports)
decides for the whole process: every such module calls ``import_kernels`` before importing from
``ttt2la.runtime.triton``. The variable is restored afterwards so nothing else in the process is affected.

The interpreter also checks every 32-bit integer add, subtract and multiply for overflow, a check a GPU
compile makes only in debug mode. At these tests' shapes no index comes within orders of magnitude of
2**31, and the check took 30 % of the kernel tests' time, so it is switched off here.
"""
import dataclasses
import importlib
import os

import torch

ON_GPU = torch.cuda.is_available()


def import_kernels() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    if not ON_GPU:
        os.environ["TRITON_INTERPRET"] = "1"
        _without_overflow_checks()
    try:
        for name in ("chunk", "channel_decay", "block", "swiglu", "tile_tuning"):
            importlib.import_module(f"ttt2la.runtime.triton.{name}")
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _without_overflow_checks() -> None:
    """Switch off the interpreter's integer overflow checks (see the module's docstring)."""
    try:
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        pass    # a Triton without this option: its interpreter keeps its checks, only slower
