"""What `status.last_sync` says of a failed sync once the daemon rolled it back."""

from __future__ import annotations

from messages.schema import Begin
from orchestrator.core import events as ev
from tests.unit.test_fsm import ENGINES, ack, bucket, finalized, finish
from tests.unit.test_fsm_recovery import ready_v1_spooled


def test_a_completed_rollback_says_so_in_the_failed_syncs_record():
    """While the rollback runs the failed sync's record says `pending`; once it is READY
    again, `last_sync.rolled_back_from.rollback` is `done` (it stayed `pending`)."""
    o = ready_v1_spooled()
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    bucket(o, 0)
    o.handle(ev.AbortSync("s2", "test"), 2.0)
    assert o.last_sync["rollback"] == "pending"
    o.handle(ev.Tick(), 3.0)
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    for e in ENGINES:
        finalized(o, e, digest="d")
    assert o.last_sync["status"] == "ROLLED_BACK"
    failed = o.last_sync["rolled_back_from"]
    assert (failed["sync_id"], failed["status"], failed["rollback"]) == ("s2", "ABORTED", "done")
