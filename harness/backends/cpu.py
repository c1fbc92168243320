"""Adapter for the CPU as a target (a sanity baseline: it must match its own reference)."""

from __future__ import annotations

from collections.abc import Callable

from harness.backends.base import Adapter


class CpuAdapter(Adapter):
    ranks_share_device = True  # the gloo control of --parallel: N ranks on one host's cores
    def device_count(self) -> int:
        return 1

    def devices(self, target: str) -> list[str]:
        if target not in ("cpu", "cpu:0"):
            raise ValueError(f"--target {target}: the CPU is one device; use --target cpu")
        return ["cpu"]

    def sharing(self) -> str:
        return "shared"  # any number of processes use the host's cores

    def perf_clock(self) -> tuple[str, Callable[[], float]]:
        """Thread CPU time: with one intra-op thread while timing, the CPU's kernels run on the calling
        thread, and other processes on a shared host only stretch the wall clock."""
        import time

        return "thread-cpu", time.thread_time
