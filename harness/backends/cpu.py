"""Adapter for the CPU as a target (a sanity baseline: it must match its own reference)."""

from __future__ import annotations

from harness.backends.base import Adapter


class CpuAdapter(Adapter):
    def device_count(self) -> int:
        return 1

    def devices(self, target: str) -> list[str]:
        if target not in ("cpu", "cpu:0"):
            raise ValueError(f"--target {target}: the CPU is one device; use --target cpu")
        return ["cpu"]
