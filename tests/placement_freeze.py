"""A `--backend` module for placement tests: it freezes (SIGSTOP) the placement process whose role
``FREEZE_ROLE`` names, a second after it is imported there, as a hung process would stop answering.
Anywhere else (the CLI's probe and the CLI itself) it does nothing."""

from __future__ import annotations

import os
import signal
import threading
import time

if os.environ.get("PORTHARNESS_PLACEMENT_ROLE") and os.environ.get("PORTHARNESS_PLACEMENT_ROLE") == os.environ.get(
        "FREEZE_ROLE"):
    def _freeze() -> None:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=_freeze, daemon=True).start()
