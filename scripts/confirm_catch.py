"""How often bugs planted from outside the harness are caught at a chip's default precision, with and without
the confirmation of ``pass_declared`` rows at full precision (``--confirm``), against the same bugs at
``--precision highest``.

Each bug lives in ``tests/planted_bugs.py``, loaded into the workers as a backend module would be
(``--backend planted_bugs``): the harness never sees it. For each bug the list runs three times on sim:
at highest (where rounding is gone: the models the bug affects drift there), at default with
``--confirm off`` (the declared envelope alone) and at default with the confirmation on. A row counts as
caught when it is ``drift``; for the KV-cache bug the first drifting step is compared with the step the bug
starts at.

    python scripts/confirm_catch.py --out /tmp/catch              # both bugs, the default lists
    python scripts/confirm_catch.py --out /tmp/catch --bugs layer_norm:2e-4 --list smoke
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUGS = {  # bug spec -> (list, extra run options)
    "layer_norm:2e-4": ("smoke", ["--ops", "full"]),
    "kv_cache:3e-2:3": ("smoke", ["--mode", "generate", "--ops", "full"]),
}
RUNS = {  # label -> options
    "highest": ["--precision", "highest", "--confirm", "off"],
    "default, --confirm off": ["--precision", "default", "--confirm", "off"],
    "default, confirmed": ["--precision", "default"],
}


def run(spec: str, lst: str, extra: list[str], label: str, options: list[str], out: Path, jobs: int
        ) -> tuple[dict[str, tuple[str, int | None, str]], float]:
    """model -> (outcome, first drifting step, confirm) of one run, and its wall seconds."""
    db = out / f"{spec.replace(':', '_')}-{label.split(',')[0].replace(' ', '_')}{'-on' if 'confirmed' in label else ''}.db"
    db.unlink(missing_ok=True)
    env = {**os.environ, "PLANTED_BUG": spec,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", lst, "--target", "sim", "--backend",
                    "planted_bugs", "--db", str(db), "--jobs", str(jobs), "--no-ref-cache", "--quiet", *extra, *options],
                   env=env, check=False, capture_output=True, text=True)
    wall = time.monotonic() - t0
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT model_id, outcome, first_drift_step, confirm FROM results").fetchall()
    return {m: (o, s, cf or "") for m, o, s, cf in rows}, wall


def caught(rows: dict[str, tuple[str, int | None, str]], affected: set[str], step: int | None) -> str:
    """How many affected models a run caught (and at which first step), and any other drift it had."""
    drift = [m for m in affected if rows.get(m, ("",))[0] == "drift"]
    text = f"{len(drift)} of {len(affected)}"
    if step is not None:
        steps = Counter(rows[m][1] for m in drift)
        text += " (first step " + ", ".join(f"{k}: {n}" for k, n in sorted(steps.items(), key=str)) + ")"
    others = [m for m, (o, _, _) in rows.items() if o == "drift" and m not in affected]
    return text + (f"; {len(others)} drift not at highest: {', '.join(sorted(others)[:4])}" if others else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bugs", nargs="*", default=list(BUGS), help="bug specs (tests/planted_bugs.py)")
    ap.add_argument("--list", default=None, help="model list (default: each bug's)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("| planted bug (outside the harness) | list | affected (drift at highest) | caught at highest | "
          "caught at default, --confirm off | caught at default, confirmed | walls (s) |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.bugs:
        lst, extra = BUGS.get(spec, ("smoke", []))
        lst = args.list or lst
        results, walls = {}, []
        for label, options in RUNS.items():
            results[label], wall = run(spec, lst, extra, label, options, args.out, args.jobs)
            walls.append(f"{wall:.0f}")
        affected = {m for m, (o, _, _) in results["highest"].items() if o == "drift"}
        step = int(spec.split(":")[2]) if spec.startswith("kv_cache") else None

        print(f"| {spec} | {lst} {' '.join(extra)} | {len(affected)} | "
              + " | ".join(caught(results[label], affected, step) for label in RUNS) + f" | {' / '.join(walls)} |")
        hidden = Counter(c for _, _, c in results["default, confirmed"].values() if c)
        print(f"|  | confirm field at default: {dict(hidden)} | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
