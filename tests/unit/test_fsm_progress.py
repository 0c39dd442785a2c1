"""Cumulative progress: an engine's `loaded {seq: k}` covers every bucket of that source up
to k; a bucket is acknowledged to the trainer once, when every live participant covered it."""

from __future__ import annotations

from orchestrator.core import commands as fsm
from orchestrator.core import events as ev
from tests.unit.test_fsm import begin, bucket, cmds, finish, new


def acks(res) -> list[int]:
    return [c.key[1] for c in cmds(res, fsm.AckBucket)]


def test_one_report_covers_every_bucket_up_to_its_seq():
    o = new()
    begin(o, 1)
    for seq in range(10):
        bucket(o, seq)
    assert acks(o.handle(ev.Loaded("e0", "s1", (0, 9)), 1.0)) == []  # e1 has applied nothing yet
    assert acks(o.handle(ev.Loaded("e1", "s1", (0, 3)), 1.0)) == [0, 1, 2, 3]
    assert acks(o.handle(ev.Loaded("e1", "s1", (0, 9)), 1.0)) == [4, 5, 6, 7, 8, 9]
    assert finish(o, 10).commands and o.state.value == "FINALIZING"


def test_an_old_or_repeated_report_changes_nothing():
    o = new()
    begin(o, 1)
    for seq in range(4):
        bucket(o, seq)
    o.handle(ev.Loaded("e0", "s1", (0, 3)), 1.0)
    assert acks(o.handle(ev.Loaded("e1", "s1", (0, 3)), 1.0)) == [0, 1, 2, 3]
    for report in ((0, 3), (0, 1), (0, 2)):
        res = o.handle(ev.Loaded("e1", "s1", report), 1.0)
        assert res.commands == [] or acks(res) == []
    assert all(b.done for b in o.sync.buckets.values())


def test_a_report_beyond_the_buckets_forwarded_acknowledges_only_those():
    """An engine cannot have applied what the daemon never forwarded: its mark stops at
    the last bucket forwarded, so a bucket forwarded later is counted by a later report."""
    o = new()
    begin(o, 1)
    bucket(o, 0)
    bucket(o, 1)
    o.handle(ev.Loaded("e0", "s1", (0, 5)), 1.0)
    assert acks(o.handle(ev.Loaded("e1", "s1", (0, 5)), 1.0)) == [0, 1]
    assert o.sync.through == {("e0", 0): 1, ("e1", 0): 1}
    bucket(o, 2)
    assert acks(o.handle(ev.Loaded("e0", "s1", (0, 2)), 1.0)) == []
    assert acks(o.handle(ev.Loaded("e1", "s1", (0, 2)), 1.0)) == [2]


def test_buckets_applied_ahead_of_a_gap_are_acknowledged_alone_then_cumulatively():
    """Reordered buckets: 2 and 3 are applied before 0 and 1; they are acknowledged as they
    complete (`also`), and the cumulative mark (`through`) waits for the gap to close."""
    o = new()
    begin(o, 1)
    for seq in (3, 2):
        bucket(o, seq)
    o.handle(ev.Loaded("e0", "s1", (0, -1), (2, 3)), 1.0)
    res = o.handle(ev.Loaded("e1", "s1", (0, -1), (3, 2)), 1.0)
    assert sorted((c.key[1], c.through) for c in cmds(res, fsm.AckBucket)) == [(2, -1), (3, -1)]
    for seq in (1, 0):
        bucket(o, seq)
    o.handle(ev.Loaded("e0", "s1", (0, 3)), 1.0)
    res = o.handle(ev.Loaded("e1", "s1", (0, 3)), 1.0)
    assert [(c.key[1], c.through) for c in cmds(res, fsm.AckBucket)] == [(0, 0), (1, 3)]
    assert finish(o, 4).commands and o.state.value == "FINALIZING"
