"""The automatic window: sized from the measured round trip and ack rate, within bounds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.trainer.stream import MAX_WINDOW, WindowSizer, window_limit


def feed(sizer: WindowSizer, rtt: float, gap: float, n: int = 20) -> int:
    now = 0.0
    for _ in range(n):
        now += gap
        sizer.acked(rtt, now)
    return sizer.size


def test_window_covers_one_round_trip_at_the_ack_rate():
    # acks every 10 ms, a round trip of 45 ms: 5 buckets cover it, one more to spare
    assert feed(WindowSizer(None, 8), rtt=0.045, gap=0.010) == 6
    # the engine is the bottleneck: acks as slow as the round trip need only 2
    assert feed(WindowSizer(None, 8), rtt=0.020, gap=0.020) == 2


def test_window_stays_within_its_bounds_and_a_fixed_window_never_moves():
    assert feed(WindowSizer(None, 8), rtt=1.0, gap=0.001) == 8
    assert feed(WindowSizer(None, 3), rtt=1.0, gap=0.001) == 3
    assert feed(WindowSizer(None, 8), rtt=0.001, gap=1.0) == 2
    assert feed(WindowSizer(5, 5), rtt=1.0, gap=0.001) == 5
    assert feed(WindowSizer(1, 1), rtt=1.0, gap=0.001) == 1


def test_the_minimum_round_trip_counts_not_the_queueing_a_big_window_adds():
    s = WindowSizer(None, 8)
    feed(s, rtt=0.025, gap=0.010)
    assert s.size == 4
    feed(s, rtt=0.080, gap=0.010)  # rtts grown by the window's own queue
    assert s.size == 4


def test_the_ceiling_keeps_window_times_bucket_bounded():
    assert window_limit(None, 16 << 20) == MAX_WINDOW
    assert window_limit(None, 64 << 20) == 2
    assert window_limit(None, 1 << 30) == 2
    assert window_limit(3, 1 << 30) == 3


@given(
    limit=st.integers(1, 64),
    rtt=st.floats(1e-6, 10.0),
    gap=st.floats(1e-6, 10.0),
    n=st.integers(1, 30),
)
def test_the_automatic_window_never_passes_the_daemons_cap(limit, rtt, gap, n):
    """The cap the daemon's begin reply allows (messages.fanout.window_cap, which its fan-out
    queue is sized for) holds whatever the acks measure, a cap of 1 included: the window's
    floor of 2 once used to override it, and 8 sources at a cap of 1 each kept 2 buckets
    in flight, overran the queue and lost buckets (tests/integration/test_fanout_bound.py)."""
    s = WindowSizer(None, limit)
    assert s.size <= limit
    assert feed(s, rtt, gap, n) <= limit
