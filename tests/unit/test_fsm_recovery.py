"""The pure FSM's rollback and catch-up decisions (the service only executes them)."""

from __future__ import annotations

import pytest

from messages.checksums import DIGEST_SCHEME, LEGACY_DIGEST_SCHEME
from messages.errors import ErrorCode, StateError, WeightSyncError
from messages.schema import Begin, Failed, Finalized, Probe, Register
from orchestrator.core import Core as Orchestrator
from orchestrator.core import Limits, Spooled, State
from orchestrator.core import commands as fsm
from orchestrator.core import events as ev
from tests.unit.test_fsm import ENGINES, ack, bucket, cmds, finalized, finish, to_ready


def spooled_new() -> Orchestrator:
    o = Orchestrator(Limits(min_engines=2, spool=True))
    for e in ENGINES:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch")), 0.0)
    return o


def ready_v1_spooled() -> Orchestrator:
    o = to_ready(spooled_new())
    o.handle(ev.SpoolChanged(Spooled(1, "d", 1)), o.now)
    return o


def rolling_back() -> Orchestrator:
    """Version 1 served and spooled; s2 touched the engines and was aborted: the daemon's
    rollback to version 1 runs (opened at the tick of t=3)."""
    o = ready_v1_spooled()
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    bucket(o, 0)
    o.handle(ev.AbortSync("s2", "test"), 2.0)
    o.handle(ev.Tick(), 3.0)
    return o


def test_a_spooled_daemon_spools_every_sync_and_commits_before_the_reply():
    o = spooled_new()
    res = o.handle(ev.BeginSync(Begin(sync_id="s1", version=1)), 1.0)
    assert cmds(res, fsm.SpoolBegin) == [fsm.SpoolBegin("s1", 1)]
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    finalized(o, "e0")
    out = o.handle(
        ev.EngineFinalized("e1", Finalized(sync_id="s1", version=1, digest="d", finalize_count=1)), 1.0
    )
    kinds = [type(c) for c in out.commands]
    assert kinds.index(fsm.SpoolCommit) < kinds.index(fsm.CompleteSync)


def test_failed_touched_sync_rolls_back_only_when_the_spool_holds_the_served_version():
    o = ready_v1_spooled()
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    bucket(o, 0)
    res = o.handle(ev.AbortSync("s2", "test"), 2.0)
    assert o.state is State.IDLE and o.dirty and o.want_rollback
    assert cmds(res, fsm.SpoolDiscard) == [fsm.SpoolDiscard("s2")]
    res = o.handle(ev.Tick(), 3.0)
    assert o.state is State.LOADING_BUCKETS and o.sync.kind == "rollback"
    assert cmds(res, fsm.StartRollback) == [fsm.StartRollback(o.sync.sync_id, 1, "d")]
    assert o.sync.expected_digest == "d" and o.sync.rollback_of["sync_id"] == "s2"
    # a trainer cannot begin while the rollback runs, and is told why
    with pytest.raises(StateError) as ei:
        o.handle(ev.BeginSync(Begin(sync_id="s3", version=3)), 3.0)
    assert ei.value.code is ErrorCode.INVALID_STATE and "rolling" in ei.value.message
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    for e in ENGINES:
        finalized(o, e, digest="d")
    assert (o.state, o.served_version, o.dirty) == (State.READY, 1, False)
    assert o.last_sync["status"] == "ROLLED_BACK"


def test_no_rollback_without_a_matching_spool_and_no_second_try_after_a_failed_one():
    o = ready_v1_spooled()
    o.handle(ev.SpoolChanged(Spooled(1, "other-digest", 1)), o.now)  # not what is served
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    bucket(o, 0)
    o.handle(ev.AbortSync("s2", "test"), 2.0)
    assert not o.want_rollback and o.handle(ev.Tick(), 3.0).commands == []
    o.handle(ev.SpoolChanged(Spooled(1, "d", 1)), o.now)
    o.want_rollback = True
    o.handle(ev.Tick(), 3.0)
    o.handle(ev.AbortSync(o.sync.sync_id, "spool unreadable", by="daemon"), 4.0)
    assert o.state is State.IDLE and not o.want_rollback  # no engine named: no loop of rollbacks
    assert o.last_sync["rollback"] == "failed"


def test_a_rollback_failing_at_one_engine_fails_that_engine_and_rolls_the_others_back():
    """The engine that refused the rollback is counted lost, named in an EngineLost; the
    rollback is opened again over the others and completes: the fleet does not end
    IDLE-dirty because one engine refused. Each retry has fewer engines, so it ends."""
    o = rolling_back()
    first = o.sync.sync_id
    res = o.handle(ev.EngineFailed("e0", Failed(sync_id=first, code="STALE_BASE", message="no base")), 4.0)
    lost = cmds(res, fsm.EngineLost)
    assert [c.engine_id for c in lost] == ["e0"] and "its rollback failed: STALE_BASE" in lost[0].cause
    assert o.engines["e0"].state.value == "LOST" and o.want_rollback and o.state is State.IDLE
    o.handle(ev.Heartbeat("e1"), 4.5)
    o.handle(ev.Tick(), 5.0)
    assert o.sync.kind == "rollback" and o.sync.sync_id != first and o.sync.participants == ("e1",)
    bucket(o, 0)
    ack(o, 0, engines=("e1",))
    finish(o, 1)
    finalized(o, "e1", digest="d")
    assert (o.state, o.served_version, o.dirty) == (State.READY, 1, False)
    # and when the last engine refuses too, nothing is left to roll back: no further try
    o.limits = Limits(min_engines=1, spool=True)
    o.handle(ev.BeginSync(Begin(sync_id="s3", version=3)), 6.0)
    bucket(o, 0)
    o.handle(ev.AbortSync("s3", "test"), 6.0)
    o.handle(ev.Heartbeat("e1"), 6.5)
    o.handle(ev.Tick(), 7.0)
    o.handle(ev.EngineFailed("e1", Failed(sync_id=o.sync.sync_id, code="ENGINE_FAILED", message="x")), 7.0)
    assert o.state is State.IDLE and not o.want_rollback and o.last_sync["rollback"] == "failed"


def test_engine_registering_at_ready_catches_up_privately_and_counts_once_finalized():
    o = ready_v1_spooled()
    res = o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0)
    (start,) = cmds(res, fsm.SendSpooled)
    assert o.engines["e2"].state == "JOINING" and o.state is State.READY
    assert (start.engine_id, start.version, start.seq) == ("e2", 1, 0)
    out = o.handle(ev.Loaded("e2", start.sync_id, (0, 0)), 5.0)
    assert not cmds(out, fsm.SendSpooled) and cmds(out, fsm.SendFinalize) == [
        fsm.SendFinalize("e2", start.sync_id, 1, (), "d")
    ]
    out = o.handle(
        ev.EngineFinalized("e2", Finalized(sync_id=start.sync_id, version=1, digest="d", finalize_count=1)),
        5.0,
    )
    assert cmds(out, fsm.CatchUpDone) == [fsm.CatchUpDone("e2", start.sync_id, True, "")]
    assert (o.engines["e2"].state, o.engines["e2"].version) == ("READY", 1)


def test_the_core_paces_a_catch_up_within_its_window_and_finalizes_after_the_last_bucket():
    o = to_ready(spooled_new())
    o.handle(ev.SpoolChanged(Spooled(1, "d", 5)), o.now)  # five spooled buckets
    res = o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0)
    sent = cmds(res, fsm.SendSpooled)
    assert [c.seq for c in sent] == list(range(o.limits.recovery_window)) == [0, 1]
    sid = sent[0].sync_id
    assert [c.seq for c in cmds(o.handle(ev.Loaded("e2", sid, (0, 0)), 5.1), fsm.SendSpooled)] == [2]
    assert not cmds(o.handle(ev.Loaded("e2", sid, (0, 0)), 5.2), fsm.SendSpooled)  # no progress: nothing
    out = o.handle(ev.Loaded("e2", sid, (0, 2)), 5.3)  # cumulative: 1 and 2 applied
    assert [c.seq for c in cmds(out, fsm.SendSpooled)] == [3, 4] and not cmds(out, fsm.SendFinalize)
    out = o.handle(ev.Loaded("e2", sid, (0, 4)), 5.4)
    assert not cmds(out, fsm.SendSpooled) and cmds(out, fsm.SendFinalize) == [
        fsm.SendFinalize("e2", sid, 1, (), "d")
    ]


def test_a_catch_up_report_past_what_was_sent_is_clamped_to_it():
    """An engine reporting seq 10**6 (or another source's seq) is held to the buckets
    sent: the window still paces the spool and no finalize goes before the last bucket."""
    o = to_ready(spooled_new())
    o.handle(ev.SpoolChanged(Spooled(1, "d", 5)), o.now)  # five spooled buckets
    res = o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0)
    sid = cmds(res, fsm.SendSpooled)[0].sync_id  # seqs 0 and 1 sent
    out = o.handle(ev.Loaded("e2", sid, (0, 10**6)), 5.1)
    assert [c.seq for c in cmds(out, fsm.SendSpooled)] == [2, 3] and not cmds(out, fsm.SendFinalize)
    out = o.handle(ev.Loaded("e2", sid, (7, 10**6)), 5.2)  # no source 7 in a spool
    assert not cmds(out, fsm.SendSpooled) and not cmds(out, fsm.SendFinalize)
    assert o.catchups["e2"].applied == 2
    out = o.handle(ev.Loaded("e2", sid, (0, 3)), 5.3)
    assert [c.seq for c in cmds(out, fsm.SendSpooled)] == [4] and not cmds(out, fsm.SendFinalize)
    out = o.handle(ev.Loaded("e2", sid, (0, 4)), 5.4)
    assert cmds(out, fsm.SendFinalize) == [fsm.SendFinalize("e2", sid, 1, (), "d")]


def test_catch_up_with_a_wrong_digest_leaves_the_engine_stale():
    o = ready_v1_spooled()
    (start,) = cmds(
        o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0), fsm.SendSpooled
    )
    o.handle(ev.Loaded("e2", start.sync_id, (0, 0)), 5.0)
    out = o.handle(
        ev.EngineFinalized("e2", Finalized(sync_id=start.sync_id, version=1, digest="bad", finalize_count=1)),
        5.0,
    )
    assert o.engines["e2"].state == "STALE" and cmds(out, fsm.SendAbort)
    assert not cmds(out, fsm.CatchUpDone)[0].ok


def test_a_new_sync_supersedes_catch_ups_and_includes_the_engine():
    o = ready_v1_spooled()
    o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0)
    res = o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 6.0)
    assert cmds(res, fsm.SendAbort) and not o.catchups
    assert "e2" in o.sync.participants and o.engines["e2"].state == "LOADING"


def test_stalled_catch_up_times_out():
    o = ready_v1_spooled()
    o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0)
    for e in ("e0", "e1", "e2"):
        o.handle(ev.Heartbeat(e), 5.0 + o.limits.bucket_timeout)
    o.handle(ev.Tick(), 5.0 + o.limits.bucket_timeout + 1)
    assert o.engines["e2"].state == "STALE" and not o.catchups


def test_the_daemons_own_sync_ids_never_repeat_across_daemon_runs():
    """An engine outlives a daemon restart and refuses a finalize for a sync_id it already
    ran: a catch-up named like one of the previous run's would never finish."""
    ids = []
    for run in ("run-a", "run-b"):  # two daemon lifetimes, same engine, same history
        o = Orchestrator(Limits(min_engines=2, spool=True), run_id=run)
        for e in ENGINES:
            o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch")), 0.0)
        to_ready(o)
        o.handle(ev.SpoolChanged(Spooled(1, "d", 1)), o.now)
        ids += [
            c.sync_id
            for c in cmds(
                o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0),
                fsm.SendSpooled,
            )
        ]
    assert len(ids) == 2 and ids[0] != ids[1]


def test_a_rollback_and_a_catch_up_check_the_spooled_versions_canaries():
    """The spool keeps a version's probes: a rollback to it and a catch-up to it finalize
    with them, and an engine that answers otherwise does not count as serving it."""
    probe = Probe(prompt=(1, 2), max_tokens=2, expected=(5, 6))
    o = ready_v1_spooled()
    o.handle(ev.SpoolChanged(Spooled(1, "d", 1, (probe,))), o.now)
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    bucket(o, 0)
    o.handle(ev.AbortSync("s2", "test"), 2.0)
    o.handle(ev.Tick(), 3.0)
    assert o.sync.kind == "rollback" and o.sync.probes == (probe,)
    bucket(o, 0)
    ack(o, 0)
    res = finish(o, 1)
    assert {c.probes for c in cmds(res, fsm.SendFinalize)} == {(probe,)}
    o.handle(
        ev.EngineFinalized(
            "e0", Finalized(sync_id=o.sync.sync_id, version=1, digest="d", finalize_count=2, probes=((5, 6),))
        ),
        3.0,
    )
    o.handle(
        ev.EngineFinalized(
            "e1", Finalized(sync_id=o.sync.sync_id, version=1, digest="d", finalize_count=2, probes=((5, 7),))
        ),
        3.0,
    )
    assert o.last_sync["code"] == "CANARY_MISMATCH" and "e1" in o.last_sync["reason"]
    # a catch-up to the spooled version carries the probes and checks the answer
    o2 = ready_v1_spooled()
    o2.handle(ev.SpoolChanged(Spooled(1, "d", 1, (probe,))), o2.now)
    (start,) = cmds(
        o2.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0), fsm.SendSpooled
    )
    out = o2.handle(ev.Loaded("e2", start.sync_id, (0, 0)), 5.0)
    assert cmds(out, fsm.SendFinalize) == [fsm.SendFinalize("e2", start.sync_id, 1, (probe,), "d")]
    out = o2.handle(
        ev.EngineFinalized(
            "e2", Finalized(sync_id=start.sync_id, version=1, digest="d", finalize_count=1, probes=((5, 0),))
        ),
        5.0,
    )
    (done,) = cmds(out, fsm.CatchUpDone)
    assert not done.ok and "CANARY_MISMATCH" in done.reason and o2.engines["e2"].state == "STALE"


def test_a_served_digest_of_another_scheme_rolls_nothing_back_and_judges_no_engine():
    """A daemon started on an older daemon's state (its served digest in the v5 scheme,
    dirty): DIGEST_SCHEME_MISMATCH in status, no rollback at a tick, no catch-up for a
    registering engine (kept STALE at the version it reports); a READY sync records this
    daemon's scheme and clears it."""
    o = Orchestrator(
        Limits(min_engines=2, spool=True),
        initial=State.IDLE,
        served_version=1,
        served_digest="d5",
        served_scheme=LEGACY_DIGEST_SCHEME,
        dirty=True,
    )
    o.handle(ev.SpoolChanged(Spooled(1, "d5", 1, scheme=LEGACY_DIGEST_SCHEME)), 0.0)
    for e in ENGINES:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch", version=1, digest="d6")), 0.0)
    assert not o.can_roll_back() and o.handle(ev.Tick(), 1.0).commands == []
    assert o.sync is None and [x.state for x in o.engines.values()] == ["STALE", "STALE"]
    err = o.scheme_error()
    assert err is not None and err.code is ErrorCode.DIGEST_SCHEME_MISMATCH
    assert err.details["recorded"] == {"served": LEGACY_DIGEST_SCHEME, "spool": LEGACY_DIGEST_SCHEME}
    snap = o.snapshot()
    assert snap["digest_scheme_error"]["code"] == "DIGEST_SCHEME_MISMATCH"
    assert snap["rollback_pending"] is False
    # the next version is pushed as usual and records this daemon's scheme
    to_ready(o, version=2)
    res = o.handle(ev.SpoolChanged(Spooled(2, "d", 1)), 2.0)
    assert o.scheme_error() is None and o.snapshot()["digest_scheme"] == DIGEST_SCHEME
    assert res.commands == []


def test_a_spool_of_another_scheme_is_not_replayed_even_with_the_served_digest():
    o = ready_v1_spooled()
    o.handle(ev.SpoolChanged(Spooled(1, "d", 1, scheme=LEGACY_DIGEST_SCHEME)), o.now)
    assert not o.can_roll_back()
    res = o.handle(ev.EngineRegistered(Register(engine_id="e2", backend="torch")), 5.0)
    assert not cmds(res, fsm.SendSpooled) and o.engines["e2"].state == "STALE"
    assert o.scheme_error().details["recorded"] == {"spool": LEGACY_DIGEST_SCHEME}


def test_a_ready_sync_journals_its_digest_with_this_daemons_scheme():
    o = to_ready(spooled_new())
    assert o.served_scheme == DIGEST_SCHEME
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    finalized(o, "e0")
    res = finalized(o, "e1")
    (row,) = [c for c in cmds(res, fsm.Journal) if c.kind == "sync"]
    assert (row.data["status"], row.data["digest_scheme"]) == ("READY", DIGEST_SCHEME)


def test_the_daemons_late_abort_of_an_ended_rollback_leaves_the_running_sync_alone():
    """The rollback feed gives up on a rollback (its finish was refused) after that
    rollback already ended and a trainer's sync began: the abort is about nothing running
    and must not touch the new sync (it used to raise, which the service counts as a bug
    and fails the running sync with INTERNAL)."""
    o = rolling_back()
    rollback = o.sync.sync_id
    assert o.sync.kind == "rollback"
    o.handle(ev.AbortSync(rollback, "stop it", by="operator"), 3.5)
    assert o.sync is None or o.sync.sync_id != rollback
    o.handle(ev.BeginSync(Begin(sync_id="s3", version=3)), 4.0)
    assert o.state is State.LOADING_BUCKETS and o.sync.sync_id == "s3"
    o.handle(ev.AbortSync(rollback, "its finish was refused", by="daemon"), 4.1)
    assert o.state is State.LOADING_BUCKETS and o.sync.sync_id == "s3"
    with pytest.raises(WeightSyncError):  # a trainer's abort of an ended sync is still refused
        o.handle(ev.AbortSync(rollback, "late"), 4.2)
