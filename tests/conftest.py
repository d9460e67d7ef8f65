"""Suite-wide setup: run ``torch.compile``-decorated code eagerly (fast on CPU) and register hypothesis profiles.

A test that needs compilation re-enables it locally with
``torch.compiler.set_stance("default")`` and ``torch._dynamo.config.patch(disable=False)``.
"""
import os

import torch
from hypothesis import HealthCheck, settings

torch._dynamo.config.disable = True
# With dynamo disabled, a ``fullgraph=True`` function raises "found no compiled frames" unless the
# stance is eager, so both switches are needed for such code to run as plain Python.
torch.compiler.set_stance("force_eager")

settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
