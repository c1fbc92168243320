"""Static HTML report of one run in the result store (``portharness report``).

The site opens straight from disk (``file://``), offline, e.g. from a CI artifact: no server, no CDN,
no ``fetch``. Table data is embedded as JSON, charts are inline SVG, and the small vanilla JS in
``assets/`` only filters and sorts. Model ids, error messages and tracebacks are untrusted text:
every template autoescapes, embedded JSON goes through ``|tojson`` and the JS only sets ``textContent``.

- ``build.py``: :func:`build_report` reads the run from the store, prepares the output directory and
  renders each page; ``main_report`` is the CLI entry point.
- ``views.py``: pure functions shaping dataframes into what each page's template needs.
- ``parallel.py``: model pages written by forked processes.
- ``svg.py``: the inline SVG charts (drift histogram, ratio bars, outcome bar, trend lines).
- ``templates/`` (Jinja2) and ``assets/`` (CSS, JS) ship as package data.
"""

from harness.report.build import build_report, check_out

__all__ = ["build_report", "check_out"]
