"""Collectives with the communication settings backends ship, over any c10d transport.

`settings.py` is the vocabulary (fused vs skinny, bucket size, message cap, per-device vs per-host
placement); `planner.py` (with `stages.py`) plans each collective of a group into messages that obey it
over gloo or nccl, and `peers.py` says which peer a failed collective lost. A process group calls the
planner: `shaped.py`'s Python group (``shaped_gloo`` / ``shaped_nccl``) or a device backend's native one
(sim's). It depends only on torch, so a benchmark of `cpu` (gloo), `cuda` (nccl) or a device backend's own
group can use it without loading any accelerator backend.
"""
