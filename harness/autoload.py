"""`torch.backends` entry points. They run inside `import torch`, so this module imports nothing of
the harness: it must load even while another harness module is half-imported."""

from __future__ import annotations

import os

SIM_AUTOLOAD_ENV = "PORTHARNESS_SIM_AUTOLOAD"


def sim() -> None:
    """Load sim at `import torch` only when opted in (PORTHARNESS_SIM_AUTOLOAD=1).

    Only one backend can own PrivateUse1 per process; claiming it in every process that imports torch
    would break any other PrivateUse1 backend installed beside portharness."""
    if os.environ.get(SIM_AUTOLOAD_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        import harness.sim  # noqa: F401
