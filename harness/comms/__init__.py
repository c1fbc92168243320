"""Collectives with the communication settings backends ship, over any c10d transport.

`settings.py` is the vocabulary (fused vs skinny, bucket size, message cap, per-device vs per-host
placement); `shaped.py` is a process group that obeys it over gloo or nccl. It depends only on torch,
so a benchmark of `cpu` (gloo), `cuda` (nccl) or a device backend's own group can use it without
loading any accelerator backend.
"""
