"""A group member that reports a failed peer (`failed.peer`: its neighbour in the relay
chain, or the trainer, closed the connection) is not taken for the culprit at once: the
core waits for the member that failed to be counted lost (its connection closed:
`engine_grace`), names it, and names the reporters only when no participant is lost
within `engine_grace + peer_fault_slack`."""

from __future__ import annotations

from messages.schema import Failed
from orchestrator.core import State
from orchestrator.core import events as ev
from tests.unit.test_fsm import begin, bucket, new

ENGINES3 = ("e0", "e1", "e2")


def _peer(o, eid: str, at: float, peer: bool = True) -> None:
    msg = Failed(
        sync_id=o.sync.sync_id, code="ENGINE_FAILED", message=f"{eid}: connection closed", seq=0, peer=peer
    )
    o.handle(ev.EngineFailed(eid, msg), at)


def _loading(o, at: float) -> None:
    for e in ENGINES3:
        o.handle(ev.Heartbeat(e), at)
    begin(o, 2)
    bucket(o, 0)


def test_the_member_that_died_is_named_not_its_neighbours():
    o = new(ENGINES3)
    _loading(o, 1.0)
    grace = o.limits.engine_grace
    o.handle(ev.EngineGone("e1"), 10.0)  # e1 was killed: its connection closed
    _peer(o, "e0", 10.0)  # its neighbours' sends and receives fail at once
    _peer(o, "e2", 10.01)
    o.handle(ev.Tick(), 10.0 + grace - 0.01)
    assert o.state is State.LOADING_BUCKETS  # nobody named yet
    o.handle(ev.Tick(), 10.0 + grace + 0.01)
    assert o.state is State.IDLE and o.last_sync["status"] == "FAILED"
    assert "e1" in o.last_sync["reason"] and "lost" in o.last_sync["reason"], o.last_sync
    assert "e0" not in o.last_sync["reason"] and "e2" not in o.last_sync["reason"], o.last_sync


def test_with_no_member_lost_the_reporters_are_named_after_the_grace_and_slack():
    o = new(ENGINES3)
    _loading(o, 1.0)
    lim = o.limits
    _peer(o, "e2", 10.0)
    o.handle(ev.Tick(), 10.0 + lim.engine_grace + lim.peer_fault_slack - 0.01)
    assert o.state is State.LOADING_BUCKETS
    o.handle(ev.Tick(), 10.0 + lim.engine_grace + lim.peer_fault_slack + 0.01)
    assert o.state is State.IDLE and o.last_sync["code"] == "ENGINE_FAILED"
    assert "['e2'] lost a member of their group" in o.last_sync["reason"], o.last_sync


def test_a_failure_of_the_engines_own_after_a_peer_report_fails_the_sync_at_once():
    o = new(ENGINES3)
    _loading(o, 1.0)
    _peer(o, "e0", 10.0)
    _peer(o, "e1", 10.0, peer=False)  # e1's own failure (a checksum, a loader): named now
    assert o.state is State.IDLE and "engine e1 failed" in o.last_sync["reason"], o.last_sync
