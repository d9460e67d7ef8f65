"""The paper's simplification steps as passes over a ``TTTProgram`` (``run_level`` applies 1..k).

Importing this package registers every pass; ``base`` holds the registry, the only place that
knows which step each pass is and so which levels exist.
"""
from .base import (MAX_LEVEL, Pass, PassContext, PassResult, PendingPass, Snapshot, check_level,
                   get_pass, implemented_level, passes_for_level, register, remedy_for,
                   remove_dead_states, run_level, run_passes)
from .absorb_lr import AbsorbLr, absorb_lr
from .collapse_mlp import CollapseMLP, collapse_mlp
from .drop_norm import DropNorm, drop_norm
from .freeze_theta import FreezeTheta, freeze_theta
from .remove_momentum import RemoveMomentum, remove_momentum
from .remove_muon import RemoveMuon, remove_muon

__all__ = ["MAX_LEVEL", "Pass", "PassContext", "PassResult", "PendingPass", "Snapshot",
           "check_level", "get_pass", "implemented_level", "passes_for_level", "register",
           "remedy_for", "remove_dead_states", "run_level", "run_passes", "FreezeTheta",
           "freeze_theta", "DropNorm", "drop_norm", "CollapseMLP", "collapse_mlp", "AbsorbLr",
           "absorb_lr", "RemoveMomentum", "remove_momentum", "RemoveMuon", "remove_muon"]
