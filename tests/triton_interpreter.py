"""Import the Triton kernel modules the way the kernel tests need them: for Triton's CPU interpreter when
there is no GPU.

Triton decides between compiling and interpreting a kernel when it is decorated, from ``TRITON_INTERPRET``,
so the first test module to import any kernel module (``_common`` included, which ``tile_tuning`` imports)
decides for the whole process: every such module calls ``import_kernels`` before importing from
``ttt2la.runtime.triton``. The variable is restored afterwards so nothing else in the process is affected.
"""
import importlib
import os

import torch

ON_GPU = torch.cuda.is_available()


def import_kernels() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    if not ON_GPU:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in ("chunk", "channel_decay", "block", "swiglu", "tile_tuning"):
            importlib.import_module(f"ttt2la.runtime.triton.{name}")
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
