"""The one timing helper: percentiles, interleaving, per-pair ratios."""

import pytest

from sere_fx.benchmark import PairedTiming, Timing, seconds, time_fn, time_paired


def test_timing_percentiles_interpolate_linearly():
    t = Timing.of([float(x) for x in (7, 1, 9, 3, 5, 10, 2, 8, 4, 6)])  # 1..10, shuffled
    # by hand: the q-quantile of 1..10 sits at rank q * 9 (0-based) between neighbours
    assert (t.median_s, t.p10_s, t.p90_s, t.repeats) == (pytest.approx(5.5), pytest.approx(1.9), pytest.approx(9.1), 10)
    assert Timing.of([0.25]).fmt(1e3, "ms") == "250.00 ms [250.00, 250.00]"


def test_time_paired_rotates_the_order_and_takes_reported_seconds():
    order = []
    own = iter([0.5, 0.25, 1.0, 2.0, 4.0, 8.0])

    def a():
        order.append("a")
        return next(own)

    def b():
        order.append("b")

    samples = time_paired({"a": a, "b": b}, repeats=3, warmup=0)
    assert order == ["a", "b", "b", "a", "a", "b"]  # each repeat starts one further round
    assert samples["a"] == [0.5, 0.25, 1.0]  # a reports its own seconds: taken as they are
    assert len(samples["b"]) == 3 and all(0 < s < 1 for s in samples["b"])  # b is timed


def test_paired_ratios_come_from_the_same_repeat():
    base, pol = [2.0, 4.0, 8.0], [1.0, 1.0, 4.0]
    timing = PairedTiming(Timing.of(base), Timing.of(pol), Timing.of([b / p for b, p in zip(base, pol)]))
    assert timing.speedup.median_s == 2.0 and timing.fmt_speedup().startswith("2.00x [")
    # the ratio of medians (4 / 1) is not the median of per-pair ratios (2, 4, 2 -> 2)
    assert timing.baseline.median_s / timing.policy.median_s == 4.0


def test_time_fn_warms_up_and_counts_every_call():
    calls = []
    t = time_fn(lambda: calls.append(1), repeats=4, warmup=3, number=5)
    assert len(calls) == 3 + 4 * 5 and t.repeats == 4
    assert 0 < seconds(lambda: sum(range(100)), number=10) < 1
