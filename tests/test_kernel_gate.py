"""The kernel gate (issue 47): a kernel's own time judged like a step's, from its profiled rounds; pure functions
over rows as `--perf` writes them, no model runs here (scripts/perf_rates.py measures the rates)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import speed
from harness.analysis.perfgate import DRIFT, gate


def _perf(ops: dict[str, tuple[float, float, float]], *, ratio: float = 1.0, spread: float = 0.02,
          target: float = 1e-3, host: dict | None = None) -> dict:
    """A row's `perf`: the step's ratio and target latency (interval `spread` each way), and an op profile
    whose ops hold (median, lo, hi) µs per step."""
    total = sum(m for m, _, _ in ops.values())
    return {"ratio": {"median": ratio, "lo": ratio * (1 - spread), "hi": ratio * (1 + spread), "n": 20},
            "target": {"median": target, "lo": target * (1 - spread), "hi": target * (1 + spread), "n": 20},
            "reference": {"median": 1e-3}, **({"host": host} if host else {}),
            "profile": {"clock": "thread-cpu", "rounds": 3, "total_us": total,
                        "ops": [[op, m] for op, (m, _, _) in sorted(ops.items(), key=lambda kv: -kv[1][0])],
                        "ci": {op: [lo, hi] for op, (_, lo, hi) in ops.items()}}}


BASE = {"aten::addmm": (600.0, 590.0, 615.0), "aten::native_layer_norm": (100.0, 97.0, 104.0),
        "aten::gelu": (40.0, 39.0, 42.0), "aten::add": (8.0, 7.5, 8.6)}
BUSY = {"wait_share": 0.4, "others_cores": 1.8, "load_per_core": 6.0, "spread": 0.3}

CASES = [  # (head ops, head step ratio & spread, host, flagged op or "")
    # layer norm 6x slower, the step 1.8x but inconclusive on a busy host: the kernel is the news
    ({**BASE, "aten::native_layer_norm": (600.0, 570.0, 640.0)}, (1.8, 0.5), BUSY, "aten::native_layer_norm"),
    # the same on a quiet host, the step itself a regression: the step gate names it already
    ({**BASE, "aten::native_layer_norm": (600.0, 570.0, 640.0)}, (1.8, 0.02), None, ""),
    # a tiny op 10x slower (below KERNEL_MIN_SHARE of the step on both sides): noise, not a kernel regression
    ({**BASE, "aten::add": (30.0, 29.0, 31.0)}, (1.04, 0.3), BUSY, ""),
    # an op whose rounds disagree (one round 4x the others): not judged
    ({**BASE, "aten::native_layer_norm": (300.0, 90.0, 1200.0)}, (1.2, 0.4), BUSY, ""),
    # an op only the head kept (warm-up, a new path): never a kernel change
    ({**BASE, "aten::_softmax": (500.0, 480.0, 520.0)}, (1.3, 0.4), BUSY, ""),
    # 1.4x: below the kernel threshold
    ({**BASE, "aten::native_layer_norm": (140.0, 136.0, 144.0)}, (1.05, 0.3), BUSY, ""),
    # 1.6x, tight rounds, quiet host: flagged; the same on a busy host, the widened interval still clears 1
    ({**BASE, "aten::native_layer_norm": (160.0, 157.0, 163.0)}, (1.06, 0.02), None, "aten::native_layer_norm"),
    ({**BASE, "aten::native_layer_norm": (160.0, 157.0, 163.0)}, (1.06, 0.3), BUSY, "aten::native_layer_norm"),
    # 1.6x whose rounds spread enough that the host's drift could explain it: flagged quiet, not on a busy host
    ({**BASE, "aten::native_layer_norm": (160.0, 100.0, 250.0)}, (1.06, 0.02), None, "aten::native_layer_norm"),
    ({**BASE, "aten::native_layer_norm": (160.0, 100.0, 250.0)}, (1.06, 0.3), BUSY, ""),
    # identical runs: nothing
    (dict(BASE), (1.0, 0.3), BUSY, ""),
    # every op twice as slow (the head's profiling window on a busier moment of the host, the step 1.13x): the
    # host's part, measured by the other ops of the same profile, not six kernel regressions (seen on a busy host)
    ({op: (m * 2.1, lo * 2.0, hi * 2.3) for op, (m, lo, hi) in BASE.items()}, (1.13, 0.3), BUSY, ""),
]


@pytest.mark.parametrize("head_ops,step,host,flagged", CASES)
def test_a_kernel_regression_is_a_steady_large_op_slower_beyond_noise(head_ops: dict, step: tuple, host: dict | None,
                                                                      flagged: str) -> None:
    base = _perf(BASE, host=host)
    head = _perf(head_ops, ratio=step[0], spread=step[1], host=host, target=1e-3 * step[0])
    res = gate([("m", "cfg", {"perf": base}, {"perf": head})])
    assert [k.op for k in res.kernels] == ([flagged] if flagged else []), [k.detail for k in res.kernels]
    for k in res.kernels:
        assert k.slowdown >= speed.KERNEL_THRESHOLD and k.lo > 1 and k.share >= speed.KERNEL_MIN_SHARE
        assert f"{k.op} self time" in k.detail and "the step:" in k.detail
        assert bool(k.why) == bool(host)  # what disturbed the timing, said


def test_a_disturbed_side_widens_the_kernels_interval_by_the_hosts_drift() -> None:
    head_ops = {**BASE, "aten::native_layer_norm": (160.0, 157.0, 163.0)}
    quiet = gate([("m", "c", {"perf": _perf(BASE)}, {"perf": _perf(head_ops, ratio=1.06, spread=0.02)})]).kernels[0]
    busy = gate([("m", "c", {"perf": _perf(BASE, host=BUSY)},
                  {"perf": _perf(head_ops, ratio=1.06, spread=0.3, host=BUSY)})]).kernels[0]
    assert busy.lo == pytest.approx(quiet.lo / DRIFT, rel=1e-6) and busy.hi == pytest.approx(quiet.hi * DRIFT, rel=1e-6)


def test_kernel_regressions_fail_diff_and_baseline_check_apart_from_step_regressions(tmp_path: Path) -> None:
    from harness.analysis.baseline import Config
    from harness.analysis.perfbase import format_perf, read_perf

    head_ops = {**BASE, "aten::native_layer_norm": (600.0, 570.0, 640.0)}
    res = gate([("m", "cfg", {"perf": _perf(BASE, host=BUSY)},
                 {"perf": _perf(head_ops, ratio=1.8, spread=0.5, host=BUSY, target=1.8e-3)})])
    assert not res.regressions and [k.model_id for k in res.kernels] == ["m"] and res.inconclusive
    from harness.analysis.perfgate import format_gate

    text = "\n".join(format_gate(res))
    assert "KERNEL REGRESSIONS" in text and "aten::native_layer_norm self time 6.0x" in text
    # a committed perf baseline keeps each op's interval, so `baseline check` judges kernels too
    path = tmp_path / "b.perf.csv"
    path.write_text(format_perf(Config("smoke", "sim", "{}"), {"m": _perf(BASE)}))
    _, read = read_perf(path)
    assert read["m"]["profile"]["ci"]["aten::native_layer_norm"] == [97.0, 104.0]
    against = gate([("m", "cfg", {"perf": read["m"]}, {"perf": _perf(head_ops, ratio=1.8, spread=0.5, host=BUSY)})])
    assert [k.op for k in against.kernels] == ["aten::native_layer_norm"]


def test_a_baseline_written_before_intervals_were_kept_still_reads() -> None:
    import tempfile

    from harness.analysis.perfbase import read_perf

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "old.perf.csv"
        p.write_text("# portharness expected speed for one configuration\n# list: smoke\n# target: sim\n# settings: {}\n"
                     "model,quantity,median,lo,hi,n,reference_s,profile_us,top_ops\n"
                     "m,ratio,1.5,1.4,1.6,20,0.001,700,aten::addmm=600 aten::gelu=40\n")
        _, read = read_perf(p)
        assert "ci" not in read["m"]["profile"]
        p.write_text(p.read_text().replace("aten::gelu=40", "aten::gelu=40[50:60]"))
        with pytest.raises(ValueError, match="the interval must read"):
            read_perf(p)
