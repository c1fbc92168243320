"""The speed statistics and the gate's rules, as pure functions: no processes, no clocks that tick."""

from __future__ import annotations

import math
import random

import pytest

from harness import speed
from harness.analysis.perfgate import compare_perf, gate, read_allowlist
from harness.run.perf import measure, profile_rounds, summaries, time_rounds


def noisy(median: float, n: int = 200, spread: float = 0.05, seed: int = 0, bursts: float = 0.1) -> list[float]:
    """Samples around `median` with a share of `bursts` (someone else's work: up to 20x longer)."""
    rng = random.Random(seed)
    return [median * math.exp(rng.gauss(0, spread)) * (1 + 19 * rng.random() if rng.random() < bursts else 1)
            for _ in range(n)]


def test_summary_is_robust_to_bursts_and_reproducible() -> None:
    s = speed.summarize(noisy(2e-3, bursts=0.2))
    assert s["n"] == 200 and s["q1"] <= s["median"] <= s["q3"] and s["lo"] <= s["median"] <= s["hi"]
    assert s["median"] == pytest.approx(2e-3, rel=0.1)  # 20% of the samples up to 20x longer: the median holds
    assert s["max"] > 5 * s["median"]
    assert speed.summarize(noisy(2e-3, bursts=0.2)) == s  # order statistics: same samples, same interval
    one = speed.summarize([0.5])
    assert (one["lo"], one["median"], one["hi"]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="no finite positive"):
        speed.summarize([0.0, float("nan"), -1.0])


def test_interval_narrows_with_samples() -> None:
    wide, narrow = speed.summarize(noisy(1.0, n=10)), speed.summarize(noisy(1.0, n=400))
    assert narrow["hi"] / narrow["lo"] < wide["hi"] / wide["lo"]


@pytest.mark.parametrize(
    ("factor", "spread", "n", "regressed"),
    [
        (1.0, 0.05, 200, False),  # the same code: no regression
        (1.1, 0.01, 400, False),  # surely slower, but under the threshold
        (1.6, 0.05, 200, True),  # far beyond both runs' noise
        (1.6, 0.8, 6, False),  # as slow, but six noisy rounds cannot tell
    ],
)
def test_regression_needs_the_threshold_and_an_interval_above_one(factor: float, spread: float, n: int,
                                                                 regressed: bool) -> None:
    base = speed.summarize(noisy(1.0, n=n, spread=spread, seed=1, bursts=0))
    head = speed.summarize(noisy(factor, n=n, spread=spread, seed=2, bursts=0))
    shift = speed.compare(base, head, threshold=1.2)
    assert shift is not None and shift.regressed is regressed
    assert shift.lo <= shift.slowdown <= shift.hi


def test_a_slowdown_past_the_threshold_that_noise_explains_is_not_a_regression() -> None:
    """Medians 1.0 -> 1.3 (past 1.2x), but five rounds each spread over 4x: the interval holds 1."""
    base = speed.summarize([0.5, 0.8, 1.0, 1.2, 2.0])
    head = speed.summarize([0.7, 1.1, 1.3, 1.6, 2.6])
    shift = speed.compare(base, head, threshold=1.2)
    assert shift is not None and shift.slowdown == pytest.approx(1.3) and shift.lo < 1 and not shift.regressed
    tight = speed.compare(speed.summarize([0.98, 0.99, 1.0, 1.01, 1.02]), speed.summarize([1.28, 1.29, 1.3, 1.31, 1.32]))
    assert tight is not None and tight.regressed  # the same medians, steady rounds: a regression


def test_faster_and_incomparable() -> None:
    base, head = {"median": 2.0, "lo": 1.9, "hi": 2.1}, {"median": 1.0, "lo": 0.95, "hi": 1.05}
    shift = speed.compare(base, head)
    assert shift is not None and shift.faster and not shift.regressed and "2.00x faster" in shift.describe()
    assert speed.compare(None, head) is None and speed.compare({"median": 0}, head) is None
    exact = speed.compare({"median": 1.0, "lo": 1.0, "hi": 1.0}, {"median": 1.3, "lo": 1.3, "hi": 1.3})
    assert exact is not None and exact.regressed  # no spread at all: the slowdown is all there is
    with pytest.raises(ValueError, match="> 1"):
        speed.compare(base, head, threshold=1.0)


def test_geomean_skips_what_is_not_a_positive_number() -> None:
    assert speed.geomean([1.0, 4.0, None, float("nan"), 0, "x"]) == pytest.approx(2.0)
    assert speed.geomean([]) is None


BASE_PROFILE = {"total_us": 1000.0, "ops": [["aten::addmm", 500.0], ["aten::_softmax", 100.0], ["aten::gelu", 400.0]]}


def test_the_op_that_added_the_time_is_named_with_its_share() -> None:
    head = {"total_us": 1410.0, "ops": [["aten::addmm", 505.0], ["aten::_softmax", 410.0], ["aten::gelu", 495.0]]}
    ops = speed.op_shifts(BASE_PROFILE, head)
    assert ops[0].op == "aten::_softmax" and ops[0].factor == pytest.approx(4.1)
    assert ops[0].share == pytest.approx(310 / 410)
    text = speed.explain(speed.Shift(1.41, 1.3, 1.5, True, False), ops, base=BASE_PROFILE, head=head)
    assert text == "1.41x slower [1.30-1.50]; aten::_softmax self time 4.1x (76% of the added time)"
    # another op measured faster (noise) leaves less added time than softmax alone added: all of it, not 300%
    shrunk = {"total_us": 1100.0, "ops": [["aten::addmm", 300.0], ["aten::_softmax", 400.0], ["aten::gelu", 400.0]]}
    ops = speed.op_shifts(BASE_PROFILE, shrunk)
    assert ops[0].op == "aten::_softmax" and ops[0].share == pytest.approx(3.0)
    text = speed.explain(speed.Shift(1.1, 1.05, 1.15, False, False), ops, base=BASE_PROFILE, head=shrunk)
    assert text.endswith("aten::_softmax self time 4.0x (100% of the added time)")


def test_a_busier_machine_is_not_an_op_getting_slower() -> None:
    # every op 1.5x (a busier host's caches): said so, not blamed on the largest
    head = {"total_us": 1500.0, "ops": [[op, us * 1.5] for op, us in BASE_PROFILE["ops"]]}
    ops = speed.op_shifts(BASE_PROFILE, head)
    text = speed.explain(speed.Shift(1.5, 1.4, 1.6, True, False), ops, base=BASE_PROFILE, head=head)
    assert "slower across ops (largest: aten::addmm 1.5x, 50% of the added time)" in text
    assert speed.explain(speed.Shift(1.5, 1.4, 1.6, True, False), []).endswith("no op profile to compare")


def test_one_kernel_change_has_one_share_whichever_model_it_is_in() -> None:
    """The share is of the step's own added time (head median - base median, the profile's clock), each op's
    time per step: a kernel that got 300 µs slower per step holds all of the added time in a small model
    and in a large one alike, whatever else its profile holds (the other ops' noise stays out)."""
    shares = []
    for other_us, noise in ((500.0, 20.0), (5000.0, -150.0), (40000.0, 200.0)):
        base = {"total_us": other_us + 100.0, "ops": [["aten::addmm", other_us], ["aten::native_layer_norm", 100.0]]}
        head = {"total_us": other_us + noise + 400.0,
                "ops": [["aten::addmm", other_us + noise], ["aten::native_layer_norm", 400.0]]}
        ops = speed.op_shifts(base, head, added_us=300.0 + 30.0)  # the step: the kernel, and 30 µs of Python
        assert ops[0].op == "aten::native_layer_norm"
        shares.append(ops[0].share)
    assert shares == [pytest.approx(300 / 330)] * 3
    shift = speed.Shift(1.3, 1.2, 1.4, True, False)
    assert speed.explain(shift, ops).endswith("aten::native_layer_norm self time 4.0x (91% of the added time)")


def test_a_busier_host_on_one_side_does_not_change_the_share() -> None:
    """compare_perf: the same kernel change (+300 µs per step at the base host's speed, the step 1.0 -> 1.3 ms)
    in two pairs; in the second the head's host made everything 1.4x slower (the interleaved ratio cancels
    it, the target's own time and its ops do not): the share of the added time is the same."""
    def pair(host: float) -> tuple[dict, dict]:
        base = {"ratio": {"median": 1.0, "lo": 0.99, "hi": 1.01}, "target": {"median": 1.0e-3},
                "profile": {"ops": [["aten::addmm", 600.0], ["aten::_softmax", 100.0]], "total_us": 700.0}}
        head = {"ratio": {"median": 1.3, "lo": 1.29, "hi": 1.31}, "target": {"median": 1.3e-3 * host},
                "profile": {"ops": [["aten::addmm", 600.0 * host], ["aten::_softmax", 400.0 * host]],
                            "total_us": 1000.0 * host}}
        return base, head

    got = [compare_perf("m", "c", *pair(host))[0] for host in (1.0, 1.4)]
    assert [c.op for c in got] == ["aten::_softmax"] * 2
    assert got[0].op_share == pytest.approx(1.0) and got[1].op_share == pytest.approx(1.0)
    assert all("aten::_softmax self time 4.0x (100% of the added time)" in c.detail for c in got), got


def test_a_speed_up_is_described_as_one() -> None:
    head = {"total_us": 690.0, "ops": [["aten::addmm", 495.0], ["aten::_softmax", 10.0], ["aten::gelu", 185.0]]}
    ops = speed.op_shifts(BASE_PROFILE, head, added_us=-300.0, faster=True)
    assert ops[0].op == "aten::gelu" and ops[0].share == pytest.approx(215 / 300)
    text = speed.explain(speed.Shift(1 / 1.45, 0.65, 0.72, False, True), ops, base=BASE_PROFILE, head=head)
    assert text == ("1.45x faster [0.65-0.72 of the base time]; aten::gelu self time 2.2x less "
                    "(72% of the time saved)"), text
    assert "slower" not in text and "added" not in text


def test_the_added_time_is_the_target_steps_own_and_only_ops_both_sides_list_are_compared() -> None:
    """compare_perf: the share is of the target step's added time on its clock (medians, head - base); a perf
    baseline keeps only its top ops, so an op it does not list is not "new" tonight."""
    base = {"ratio": {"median": 1.40, "lo": 1.38, "hi": 1.42}, "target": {"median": 1.00e-3},
            "profile": {"ops": [["aten::addmm", 370.0], ["aten::mul", 300.0]], "total_us": 1000.0}}  # truncated
    head = {"ratio": {"median": 1.96, "lo": 1.94, "hi": 1.98}, "target": {"median": 1.40e-3},
            "profile": {"ops": [["aten::addmm", 730.0], ["aten::mul", 300.0], ["aten::gelu", 330.0]],
                        "total_us": 1360.0}}
    change, shift = compare_perf("m", "c", base, head)
    assert shift.regressed and change.op == "aten::addmm" and change.op_share == pytest.approx(0.9)
    assert "aten::addmm self time 2.0x (90% of the added time)" in change.detail, change.detail
    assert "gelu" not in change.detail
    complete = {**base, "profile": {**base["profile"], "total_us": 670.0}}  # the same list, now all of it
    kept = {**base["profile"], "floor_us": 300.0}  # a committed baseline: what it dropped had at most 300 us
    shifts = speed.op_shifts(kept, head["profile"], added_us=400.0)
    assert shifts[0].op == "aten::addmm" and not shifts[0].at_least
    assert [(o.op, o.at_least, o.base_us) for o in shifts[1:]] == [("aten::gelu", True, 300.0)]  # at least 1.1x
    new = speed.op_shifts(complete["profile"], head["profile"], added_us=400.0)
    assert {o.op for o in new} == {"aten::addmm", "aten::gelu"} and math.isinf(new[1].factor)


def test_profiles_on_different_clocks_are_not_compared() -> None:
    base, head = {**BASE_PROFILE, "clock": "host"}, {**BASE_PROFILE, "clock": "thread-cpu"}
    text = speed.explain(speed.Shift(1.5, 1.4, 1.6, True, False), [], base=base, head=head)
    assert text.endswith("the op profiles are on different clocks (host, thread-cpu): not compared")


def test_top_ops_keep_order_and_drop_the_noise() -> None:
    kept = speed.top_ops({"aten::a": 10.0, "aten::b": 1000.0, "aten::c": 0.5, "aten::d": 300.0}, limit=2)
    assert kept == [["aten::b", 1000.0], ["aten::d", 300.0]]
    assert speed.top_ops({}) == []


class FakeClock:
    """A wall clock each step advances by its own cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rounds_interleave_and_follow_the_budget() -> None:
    clock, calls = FakeClock(), []

    def step(name: str, cost: float):
        def run() -> None:
            calls.append(name)
            clock.now += cost
        return run

    samples = time_rounds({"target": step("t", 0.01), "reference": step("r", 0.03)}, 1.0, wall=clock, warmup=1,
                          adaptive=False)
    rounds = len(samples["wall"]["target"])
    assert rounds == 25 == len(samples["wall"]["reference"])  # 1 s of 40 ms rounds
    assert calls[:2] == ["t", "r"] and calls[2:6] == ["t", "r", "r", "t"]  # warm-up, then rotating order
    assert samples["wall"]["target"][0] == pytest.approx(0.01) and samples["wall"]["reference"][0] == pytest.approx(0.03)


def test_slow_models_get_the_minimum_rounds_then_a_hard_cap() -> None:
    clock = FakeClock()

    def slow() -> None:
        clock.now += 0.5

    assert len(time_rounds({"target": slow}, 1.0, wall=clock, adaptive=False)["wall"]["target"]) == 5  # min rounds beat the budget
    clock.now = 0.0

    def glacial() -> None:
        clock.now += 4.0

    assert len(time_rounds({"target": glacial}, 1.0, wall=clock, adaptive=False)["wall"]["target"]) == 3  # 5x budget: stop at 3
    clock.now = 0.0

    def fast() -> None:
        clock.now += 1e-6

    assert len(time_rounds({"target": fast}, 1.0, wall=clock, adaptive=False)["wall"]["target"]) == 200  # max rounds


def test_summaries_pair_the_rounds() -> None:
    out = summaries({"target": [2.0, 4.0, 6.0], "reference": [1.0, 2.0, 3.0], "eager": [4.0, 8.0, 12.0]})
    assert out["ratio"]["median"] == 2.0 and out["ratio"]["lo"] == out["ratio"]["hi"] == 2.0
    assert out["speedup"]["median"] == 2.0
    assert set(out) == {"target", "reference", "eager", "ratio", "speedup"}
    assert profile_rounds(None) == 3 and profile_rounds(0.001) == 5 and profile_rounds(5.0) == 3


def test_a_failing_step_loses_no_verdict_only_the_speed() -> None:
    def broken() -> None:
        raise RuntimeError("device lost")

    out = measure({"target": broken}, budget_s=0.01)
    assert "RuntimeError: device lost" in out["perf"]["error"] and "perf_target_s" not in out
    out = measure({"target": lambda: None}, budget_s=0.01, profile=broken)
    assert out["perf_target_s"] is not None and "device lost" in out["perf"]["profile_error"]


def _row(ratio: float, spread: float, *, seed: int, ref: float = 1e-3, profile: dict | None = None) -> dict:
    s = speed.summarize(noisy(ratio, n=100, spread=spread, seed=seed, bursts=0))
    return {"perf": {"ratio": s, "target": speed.summarize(noisy(ratio * ref, seed=seed)),
                     "reference": {"median": ref, "lo": ref, "hi": ref}, **({"profile": profile} if profile else {})}}


def test_gate_rules_as_a_table(tmp_path) -> None:
    head_profile = {"total_us": 1410.0, "ops": [["aten::addmm", 500.0], ["aten::_softmax", 410.0], ["aten::gelu", 500.0]]}
    pairs = [
        ("same", "c", _row(1.5, 0.03, seed=1), _row(1.5, 0.03, seed=2)),
        ("slower", "c", _row(1.5, 0.03, seed=3, profile=BASE_PROFILE), _row(2.1, 0.03, seed=4, profile=head_profile)),
        ("noisy", "c", _row(1.5, 0.03, seed=5), _row(2.1, 0.03, seed=6)),  # allowlisted below
        ("faster", "c", _row(1.5, 0.03, seed=7), _row(0.9, 0.03, seed=8)),
        ("crashed", "c", _row(1.5, 0.03, seed=9), {"perf": {}}),  # no speed tonight: the outcome gate's business
        ("failed", "c", _row(1.5, 0.03, seed=9), {"perf": {"error": "RuntimeError: x", "ratio": {"median": 9}}}),
        ("untimed", "c", {"perf": None}, _row(9.0, 0.03, seed=10)),
    ]
    allow = tmp_path / "perf-allow.txt"
    allow.write_text("nois*  # shares its host with the nightly's own shards\n")
    res = gate(pairs, threshold=1.2, allowlist=read_allowlist(str(allow)))
    assert [c.model_id for c in res.regressions] == ["slower"]
    assert [c.model_id for c in res.allowlisted] == ["noisy"] and "shares its host" in res.allowlisted[0].note
    assert [c.model_id for c in res.faster] == ["faster"] and res.compared == 4
    slower = res.regressions[0]
    assert slower.quantity == "ratio" and slower.op == "aten::_softmax" and slower.slowdown == pytest.approx(1.4, rel=0.02)
    assert "aten::_softmax self time 4.1x" in slower.detail
    with pytest.raises(ValueError, match="must be > 1"):
        gate(pairs, threshold=0.9)


def test_latency_is_compared_when_a_side_has_no_reference() -> None:
    base = {"target": speed.summarize(noisy(1e-3, seed=1, bursts=0))}
    head = {"target": speed.summarize(noisy(2e-3, seed=2, bursts=0)),
            "ratio": {"median": 3.0, "lo": 2.9, "hi": 3.1}}
    compared = compare_perf("m", "c", base, head)
    assert compared is not None and compared[0].quantity == "target" and compared[1].regressed


def test_a_compiled_target_is_timed_beside_its_eager_self() -> None:
    """The eager step runs the compiled module's own code (set_stance force_eager): only the target step
    calls the compiled graph, and the speedup is eager / compiled per round."""
    from types import SimpleNamespace

    import torch

    from harness.backends import adapter_for
    from harness.run.modes import Plan
    from harness.run.perf import measure_model

    calls = []

    def counting(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    plan = Plan(lambda m, x: {"y": m(x["x"]).detach()}, {"x": torch.randn(2, 8)})
    target = SimpleNamespace(model=torch.compile(model, backend=counting), inputs=plan.inputs)
    out = measure_model(plan, model, target, "cpu", adapter_for("cpu"), {}, 0.05, compiled=True)
    perf = out["perf"]
    assert {"target", "eager", "reference", "ratio", "speedup"} <= perf.keys(), perf.get("error")
    assert out["perf_speedup"] == perf["speedup"]["median"] > 0 and perf["clock"] == "thread-cpu"
    assert len(calls) == 2 + perf["target"]["n"] + perf["profile"]["rounds"]  # warm-up, rounds, profile: target only
