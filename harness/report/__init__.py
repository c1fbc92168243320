"""Static HTML report built from the result store."""

from harness.report.build import build_report

__all__ = ["build_report"]
