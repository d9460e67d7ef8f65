"""The paper's simplification steps as passes over a ``TTTProgram`` (``run_level`` applies 1..k)."""
from .base import (MAX_LEVEL, Pass, PassResult, PendingPass, get_pass, passes_for_level,
                   register, remove_dead_states, run_level)
from .drop_norm import DropNorm, drop_norm
from .freeze_theta import FreezeTheta, freeze_theta

__all__ = ["MAX_LEVEL", "Pass", "PassResult", "PendingPass", "get_pass", "passes_for_level",
           "register", "remove_dead_states", "run_level", "DropNorm", "drop_norm",
           "FreezeTheta", "freeze_theta"]
