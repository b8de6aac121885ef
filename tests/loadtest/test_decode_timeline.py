"""The decode time line's arithmetic (loadtest/bench/decode_timeline.py) on kernels laid out by
hand: overlapping kernels count once, gaps are idle, long gaps are bubbles, names add up."""
from __future__ import annotations

import pytest

from loadtest.bench.decode_timeline import timeline

US = 1_000  # the profiler's times are ns


def test_busy_idle_and_bubbles_per_step():
    # two steps; in each: a (0-10 us), b overlapping a (8-20, launched early), a 2 us gap, c (22-30),
    # then a 10 us gap to the next step
    one = [(0, 10, "a"), (8, 20, "b"), (22, 30, "c")]
    intervals = [(s * US + off, e * US + off, n) for off in (0, 40 * US) for s, e, n in one]
    t = timeline(intervals, steps=2)
    assert t.step_ms == pytest.approx(70 / 2 / 1e3)  # 0 .. 70 us over two steps
    assert t.busy_ms == pytest.approx(2 * 28 / 2 / 1e3)  # 20 + 8 us a step
    assert t.idle_ms == pytest.approx((2 + 10 + 2) / 2 / 1e3)  # the last step's trailing gap is outside
    assert t.kernels_per_step == 3
    assert t.bubbles_per_step == pytest.approx(0.5)  # one gap over 5 us in the window
    by_name = {k.name: k for k in t.kernels}
    # b launched early (8 us) but only its time past a's end (10..20) is its own
    assert by_name["b"].us_per_step == pytest.approx(10) and by_name["b"].launches_per_step == 1
    assert by_name["a"].us_per_step == pytest.approx(10)
    assert [k.name for k in t.kernels][2] == "c"  # heaviest first
    assert by_name["c"].longest_us == pytest.approx(8)
    assert sum(k.us_per_step for k in t.kernels) == pytest.approx(t.busy_ms * 1e3)  # the shares tile the busy time
    assert t.gaps[0] == (10.0, "c", "a")  # the longest gap, between the kernels around it
    assert [g[0] for g in t.gaps] == [10.0, 2.0, 2.0]


def test_a_kernel_inside_another_adds_no_busy_time():
    t = timeline([(0, 100 * US, "long"), (10 * US, 20 * US, "short"), (150 * US, 160 * US, "after")], steps=1)
    assert t.busy_ms == pytest.approx(0.110)
    assert t.idle_ms == pytest.approx(0.050)
    assert {k.name: k.us_per_step for k in t.kernels} == pytest.approx({"long": 100, "short": 0, "after": 10})


def test_no_device_activity_is_an_error():
    with pytest.raises(ValueError, match="no device activity"):
        timeline([], steps=1)
