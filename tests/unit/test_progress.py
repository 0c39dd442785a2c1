"""An engine's progress (messages.progress): cumulative reports, seqs ahead of a gap in
`also`, nothing re-reported, and `also` never longer than MAX_ALSO (the rest follows)."""

from __future__ import annotations

from messages.progress import Progress
from messages.schema import MAX_ALSO


def test_reports_are_cumulative_and_carry_seqs_ahead_of_a_gap():
    p = Progress("s")
    for seq in (0, 1, 3, 4):
        p.apply(0, seq, 0.5)
    (r,) = p.reports()
    assert (r.seq, r.also, r.count, r.seconds) == (1, (3, 4), 4, 2.0)
    assert p.reports() == [] and not p.unreported()
    p.apply(0, 2)
    (r,) = p.reports()
    assert (r.seq, r.also, r.count) == (4, (), 1)
    assert p.again(0, 3).seq == 4 and p.again(0, 3).also == ()


def test_also_is_capped_and_the_rest_goes_in_the_next_report():
    p = Progress("s")
    for seq in range(1, MAX_ALSO + 11):
        p.apply(0, seq)
    first = p.reports()[0]
    assert first.seq == -1 and len(first.also) == MAX_ALSO
    second = p.reports()[0]
    assert second.also == tuple(range(MAX_ALSO + 1, MAX_ALSO + 11))
    assert p.again(0, 5).also == (5,)
