"""The pure FSM: a table over every (state, trigger) pair, scenarios, and random orders."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from messages.errors import ErrorCode, WeightSyncError
from messages.replies import BucketAck, decode
from messages.schema import (
    Begin,
    Bucket,
    Committed,
    Failed,
    Finalized,
    Finish,
    ParamSpec,
    Prepared,
    Probe,
    Register,
    TensorMeta,
)
from orchestrator.core import ACTIVE, Limits, State
from orchestrator.core import Core as Orchestrator
from orchestrator.core import commands as fsm
from orchestrator.core import events as ev
from orchestrator.core.table import Outcome, Trigger

S = State
META = (TensorMeta("w", "float32", (4,), 0, 16),)
ENGINES = ("e0", "e1")


def new(engines=ENGINES, **kw) -> Orchestrator:
    o = Orchestrator(Limits(min_engines=len(engines)), **kw)
    for e in engines:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch")), 0.0)
    return o


def cmds(res, kind):
    return [c for c in res.commands if isinstance(c, kind)]


def begin(o, version, sync_id=None):
    return o.handle(ev.BeginSync(Begin(sync_id=sync_id or f"s{version}", version=version)), 1.0)


def bucket(o, seq, sync_id=None, nbytes=16):
    sid = sync_id or o.sync.sync_id
    return o.handle(ev.BucketIn(Bucket(sync_id=sid, seq=seq, tensors=META, checksum=0), nbytes), 1.0)


def ack(o, seq, engines=ENGINES):
    out = []
    for e in engines:
        out += o.handle(ev.Loaded(e, o.sync.sync_id, (0, seq)), 1.0).commands
    return out


def finish(o, n):
    return o.handle(ev.FinishSync(Finish(sync_id=o.sync.sync_id, buckets=n)), 1.0)


def finalized(o, engine, digest="d", version=None, count=1):
    s = o.sync
    return o.handle(
        ev.EngineFinalized(
            engine,
            Finalized(sync_id=s.sync_id, version=version or s.version, digest=digest, finalize_count=count),
        ),
        1.0,
    )


def to_loading(o=None, version=1):
    o = o or new()
    begin(o, version)
    bucket(o, 0)
    ack(o, 0)
    return o


def to_finalizing(o=None, version=1):
    o = to_loading(o, version)
    finish(o, 1)
    return o


def to_ready(o=None, version=1):
    o = to_finalizing(o, version)
    for e in ENGINES:
        finalized(o, e)
    return o


STATES = {S.IDLE: new, S.LOADING_BUCKETS: to_loading, S.FINALIZING: to_finalizing, S.READY: to_ready}


def fire(o: Orchestrator, trigger: str):
    sid = o.sync.sync_id if o.sync else "s-none"
    version = (o.sync.version if o.sync else (o.last_ready_version or 0)) + 1
    if trigger == "begin":
        return o.handle(ev.BeginSync(Begin(sync_id=f"new{version}", version=version)), 2.0)
    if trigger == "bucket":
        return o.handle(ev.BucketIn(Bucket(sync_id=sid, seq=1, tensors=META, checksum=0), 16), 2.0)
    if trigger == "finish":
        return o.handle(ev.FinishSync(Finish(sync_id=sid, buckets=1)), 2.0)
    if trigger == "finalized":
        res = None
        for e in ENGINES:
            res = o.handle(
                ev.EngineFinalized(
                    e,
                    Finalized(
                        sync_id=sid, version=o.sync.version if o.sync else 1, digest="d", finalize_count=1
                    ),
                ),
                2.0,
            )
        return res
    if trigger == "prepared":  # these syncs are not collective streams: nothing to prepare
        return o.handle(ev.EnginePrepared("e0", Prepared(sync_id=sid, buckets=1, nbytes=1, chain=0)), 2.0)
    if trigger == "committed":  # these engines do not label their outputs: nothing to commit
        return o.handle(ev.EngineCommitted("e0", Committed(sync_id=sid, version=version, label="x")), 2.0)
    if trigger == "abort":
        return o.handle(ev.AbortSync(sid, "test"), 2.0)
    if trigger == "failed":
        return o.handle(ev.EngineFailed("e0", Failed(sync_id=sid, code="SHAPE_MISMATCH", message="x")), 2.0)
    raise ValueError(trigger)


# (state, trigger) -> resulting state, or an ErrorCode if refused, or None if ignored
TABLE = {
    (S.IDLE, "begin"): S.LOADING_BUCKETS,
    (S.IDLE, "bucket"): ErrorCode.UNKNOWN_SYNC,  # no sync runs: which one is named
    (S.IDLE, "finish"): ErrorCode.INVALID_STATE,
    (S.IDLE, "prepared"): None,
    (S.IDLE, "committed"): None,
    (S.IDLE, "finalized"): None,
    (S.IDLE, "abort"): ErrorCode.UNKNOWN_SYNC,  # no sync runs: which one is named
    (S.IDLE, "failed"): None,
    (S.LOADING_BUCKETS, "begin"): ErrorCode.INVALID_STATE,
    (S.LOADING_BUCKETS, "bucket"): S.LOADING_BUCKETS,
    (S.LOADING_BUCKETS, "finish"): S.FINALIZING,
    (S.LOADING_BUCKETS, "prepared"): None,
    (S.LOADING_BUCKETS, "committed"): None,
    (S.LOADING_BUCKETS, "finalized"): None,
    (S.LOADING_BUCKETS, "abort"): S.IDLE,
    (S.LOADING_BUCKETS, "failed"): S.IDLE,
    (S.FINALIZING, "begin"): ErrorCode.INVALID_STATE,
    (S.FINALIZING, "bucket"): ErrorCode.INVALID_STATE,
    (S.FINALIZING, "finish"): ErrorCode.INVALID_STATE,
    (S.FINALIZING, "prepared"): None,
    (S.FINALIZING, "committed"): None,
    (S.FINALIZING, "finalized"): S.READY,
    (S.FINALIZING, "abort"): S.IDLE,
    (S.FINALIZING, "failed"): S.IDLE,
    (S.READY, "begin"): S.LOADING_BUCKETS,
    (S.READY, "bucket"): ErrorCode.UNKNOWN_SYNC,  # no sync runs: which one is named
    (S.READY, "finish"): ErrorCode.INVALID_STATE,
    (S.READY, "prepared"): None,
    (S.READY, "committed"): None,
    (S.READY, "finalized"): None,
    (S.READY, "abort"): ErrorCode.UNKNOWN_SYNC,  # no sync runs: which one is named
    (S.READY, "failed"): None,
}


# the inputs a sync's life is made of: the trainer's and the engines' answers
SYNC_TRIGGERS = ("begin", "bucket", "finish", "prepared", "finalized", "committed", "failed", "abort")


def test_table_covers_every_state_and_trigger():
    assert set(TABLE) == {(s, t) for s in State for t in SYNC_TRIGGERS}


def _snap(o):
    return json.dumps(o.snapshot(), sort_keys=True, default=str)


@pytest.mark.parametrize("state,trigger", sorted(TABLE, key=str), ids=lambda x: str(getattr(x, "value", x)))
def test_every_state_and_trigger(state, trigger):
    o = STATES[state]()
    assert o.state == state
    expected = TABLE[(state, trigger)]
    before = _snap(o)
    if isinstance(expected, ErrorCode):
        with pytest.raises(WeightSyncError) as ei:
            fire(o, trigger)
        assert ei.value.code is expected
        assert ei.value.state == state.value  # the error says where the daemon is
        assert o.state == state and _snap(o) == before  # refused: nothing changed
    elif expected is None:
        fire(o, trigger)
        assert o.state == state and _snap(o) == before
    else:
        fire(o, trigger)
        assert o.state == expected


def test_finalize_is_sent_once_per_engine_per_sync():
    o = to_loading()
    res = finish(o, 1)
    assert sorted(c.engine_id for c in cmds(res, fsm.SendFinalize)) == list(ENGINES)
    with pytest.raises(WeightSyncError) as ei:
        finish(o, 1)
    assert ei.value.code is ErrorCode.INVALID_STATE and ei.value.state == "FINALIZING"
    for e in ENGINES:
        assert not cmds(finalized(o, e), fsm.SendFinalize)
    assert o.state == S.READY


def test_second_finish_after_ready_says_state_and_version():
    o = to_ready(version=4)
    with pytest.raises(WeightSyncError) as ei:
        o.handle(ev.FinishSync(Finish(sync_id="s4", buckets=1)), 3.0)
    assert (ei.value.code, ei.value.state, ei.value.version) == (ErrorCode.INVALID_STATE, "READY", 4)


def test_finish_with_missing_buckets_is_incomplete_and_retryable():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    ack(o, 0)
    with pytest.raises(WeightSyncError) as ei:
        finish(o, 2)
    assert ei.value.code is ErrorCode.INCOMPLETE_SYNC and "missing bucket seq [1]" in ei.value.message
    assert o.state == S.LOADING_BUCKETS
    bucket(o, 1)
    ack(o, 1)
    finish(o, 2)
    assert o.state == S.FINALIZING


def test_finish_before_engines_applied_is_incomplete():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    o.handle(ev.Loaded("e0", "s1", (0, 0)), 1.0)
    with pytest.raises(WeightSyncError) as ei:
        finish(o, 1)
    assert ei.value.code is ErrorCode.INCOMPLETE_SYNC


def test_bucket_is_acked_only_when_every_engine_applied_it():
    o = new()
    begin(o, 1)
    res = bucket(o, 0)
    assert res.reply is None and cmds(res, fsm.ForwardBucket)[0].engine_ids == ENGINES
    assert not o.handle(ev.Loaded("e0", "s1", (0, 0)), 1.0).commands
    assert cmds(o.handle(ev.Loaded("e1", "s1", (0, 0)), 1.0), fsm.AckBucket)


def test_resent_bucket_is_acked_not_forwarded_again():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    again = bucket(o, 0)
    assert again.reply is None and not cmds(again, fsm.ForwardBucket)  # acked when applied
    ack(o, 0)
    third = bucket(o, 0)
    got = decode(third.reply or {}, BucketAck)
    assert (got.seq, got.duplicate, got.through) == (0, True, None) and not third.commands


def test_stale_version_is_refused_and_state_kept():
    o = to_ready(version=3)
    for v in (2, 3):
        with pytest.raises(WeightSyncError) as ei:
            begin(o, v, sync_id=f"x{v}")
        assert ei.value.code is ErrorCode.STALE_VERSION
    assert o.state == S.READY and o.served_version == 3


def test_begin_without_enough_engines_is_no_engines():
    o = new(engines=("e0",))
    o.limits = Limits(min_engines=2)
    with pytest.raises(WeightSyncError) as ei:
        begin(o, 1)
    assert ei.value.code is ErrorCode.NO_ENGINES and o.state == S.IDLE


def test_no_engines_says_live_against_registered_and_names_the_lost():
    """Three registered, one lost: the refusal says 2 live of 3 registered (it said
    '2 engine(s) registered', which an operator who sees 3 in status cannot square)."""
    o = new(engines=("e0", "e1", "e2"))
    o.limits = Limits(min_engines=3, engine_timeout=5.0)
    for e in ("e0", "e1"):
        o.handle(ev.Heartbeat(e), 9.0)
    o.handle(ev.Tick(), 10.0)  # e2 silent since 0.0: lost
    with pytest.raises(WeightSyncError) as ei:
        begin(o, 1)
    assert ei.value.code is ErrorCode.NO_ENGINES
    assert ei.value.message == "2 live engine(s) of 3 registered, 3 required (lost: e2)"
    assert o.state == S.IDLE


def test_repeated_begin_is_idempotent():
    o = new()
    begin(o, 1)
    again = begin(o, 1)
    assert again.reply["repeated"] is True and not again.commands and o.state == S.LOADING_BUCKETS


def test_lost_engine_fails_the_sync_dirty():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    o.handle(ev.Heartbeat("e0"), 10.0)
    res = o.handle(ev.Tick(), 1.0 + o.limits.engine_timeout + 1)
    assert o.state == S.IDLE and o.dirty and o.served_version is None
    (done,) = cmds(res, fsm.CompleteSync)
    assert done.error.code is ErrorCode.ENGINE_FAILED and "e1" in done.error.message


def test_a_lost_engine_is_said_lost_by_its_closed_connection_or_by_its_silence():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    o.handle(ev.Heartbeat("e0"), 10.0)
    o.handle(ev.EngineGone("e0"), 10.5)  # e0's connection closed; e1 just went silent
    o.handle(ev.Heartbeat("e1"), 1.0)
    res = o.handle(ev.Tick(), 10.0 + o.limits.engine_timeout + 1)
    (done,) = cmds(res, fsm.CompleteSync)
    msg = done.error.message
    assert "e0: its connection closed" in msg, msg
    silent = 10.0 + o.limits.engine_timeout + 1 - 1.0
    assert f"e1: no heartbeat for {silent:.1f}s (--engine-timeout {o.limits.engine_timeout}s)" in msg, msg


def _states(o):
    return {e["engine_id"]: e["state"] for e in o.snapshot()["engines"]}


def test_a_closed_connection_has_the_engine_grace_and_a_goodbye_none():
    """An engine whose connection closed stays in the fleet `engine_grace` seconds (a
    reconnect heard meanwhile keeps it); one that said goodbye is out at the next tick."""
    o = to_ready()
    grace = o.limits.engine_grace
    o.handle(ev.Heartbeat("e0"), 10.0)
    o.handle(ev.Heartbeat("e1"), 10.0)
    o.handle(ev.EngineGone("e0"), 10.0)  # closed, no goodbye
    o.handle(ev.Tick(), 10.0 + grace - 0.01)
    assert _states(o) == {"e0": "READY", "e1": "READY"}
    o.handle(ev.Tick(), 10.0 + grace + 0.01)  # past it
    assert _states(o) == {"e0": "LOST", "e1": "READY"}
    # e1: closed, then heard from again within the grace (its process reconnected): kept
    o.handle(ev.EngineGone("e1"), 20.0)
    o.handle(ev.Heartbeat("e1"), 20.0 + grace / 2)
    o.handle(ev.Tick(), 20.0 + grace + 0.01)
    assert _states(o)["e1"] == "READY"
    # a replacement process (killed, restarted at once) takes the id while the grace runs;
    # while the holder's connection is open, another process is refused
    with pytest.raises(WeightSyncError) as ei:
        o.handle(
            ev.EngineRegistered(Register(engine_id="e1", backend="torch", pid=2), other_connection=True), 25.0
        )
    assert ei.value.code is ErrorCode.DUPLICATE_ENGINE
    o.handle(ev.EngineGone("e0"), 25.0)  # e0 is LOST already: nothing changes
    o.handle(ev.Heartbeat("e1"), 25.0)
    o.handle(ev.EngineGone("e1"), 25.0)
    o.handle(
        ev.EngineRegistered(Register(engine_id="e1", backend="torch", pid=3), other_connection=True), 25.5
    )
    assert _states(o)["e1"] in ("STALE", "JOINING", "READY")
    # and a goodbye: out at the next tick, said so
    before = _states(o)["e1"]
    res = o.handle(ev.EngineGone("e1", goodbye=True), 30.0)
    assert _states(o)["e1"] == before != "LOST"  # counted at the tick the service runs right after
    res = o.handle(ev.Tick(), 30.0)
    assert _states(o)["e1"] == "LOST"
    (lost,) = [c for c in res.commands if type(c).__name__ == "EngineLost"]
    assert "said goodbye" in lost.cause, lost


def test_a_lost_engines_record_expires_after_lost_expiry_and_it_may_register_anew():
    """A LOST engine stays in the fleet's record `lost_expiry` seconds, then is forgotten
    (EngineForgotten: the service drops its routing id and metrics); others stay."""
    o = Orchestrator(Limits(min_engines=1, engine_timeout=5.0, lost_expiry=60.0))
    for e in ENGINES:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch")), 0.0)
    for t in (4.0, 8.0, 12.0, 70.0, 75.0):
        o.handle(ev.Heartbeat("e0"), t)
    o.handle(ev.Tick(), 6.0)  # e1 silent past engine_timeout: LOST at 6.0
    assert o.engines["e1"].state == "LOST"
    assert not cmds(o.handle(ev.Tick(), 65.9), fsm.EngineForgotten) and "e1" in o.engines
    res = o.handle(ev.Tick(), 66.0)
    assert cmds(res, fsm.EngineForgotten) == [fsm.EngineForgotten("e1")]
    assert list(o.engines) == ["e0"] and [x["engine_id"] for x in o.snapshot(66.0)["engines"]] == ["e0"]
    assert not cmds(o.handle(ev.Tick(), 76.0), fsm.EngineForgotten)  # once
    o.handle(ev.EngineRegistered(Register(engine_id="e1", backend="torch")), 77.0)
    assert o.engines["e1"].state == "STALE"


def test_an_abort_is_filed_under_the_trainers_code_and_who_asked():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    res = o.handle(ev.AbortSync("s1", "bad shape", ErrorCode.SHAPE_MISMATCH, "trainer"), 2.0)
    (done,) = cmds(res, fsm.CompleteSync)
    assert done.error.code is ErrorCode.SHAPE_MISMATCH
    assert o.last_sync["code"] == "SHAPE_MISMATCH" and o.last_sync["by"] == "trainer"
    (journal,) = [j for j in cmds(res, fsm.Journal) if j.kind == "sync"]
    assert journal.data["code"] == "SHAPE_MISMATCH" and journal.data["by"] == "trainer"
    begin(o, 2)
    o.handle(ev.AbortSync("s2", "stop", None, "operator"), 3.0)
    assert o.last_sync["code"] == "ABORTED" and o.last_sync["by"] == "operator"
    assert o.last_sync["reason"] == "sync aborted by an operator: stop"
    begin(o, 3)
    o.handle(ev.AbortSync("s3", "x", ErrorCode.INTERNAL), 4.0)  # a peer cannot file a daemon bug
    assert o.last_sync["code"] == "ABORTED"


def test_untouched_sync_rolls_back_to_ready():
    o = to_ready(version=1)
    begin(o, 2)
    o.handle(ev.AbortSync("s2", "changed my mind"), 2.0)
    assert o.state == S.READY and o.served_version == 1 and not o.dirty


def test_touched_sync_abort_leaves_idle_dirty_and_tells_engines():
    o = to_ready(version=1)
    begin(o, 2)
    bucket(o, 0)
    res = o.handle(ev.AbortSync("s2", "x"), 2.0)
    assert o.state == S.IDLE and o.dirty and o.served_version is None
    assert cmds(res, fsm.SendAbort)[0].engine_ids == ENGINES


def test_trainer_vanishing_mid_sync_times_out():
    o = new()
    begin(o, 1)
    bucket(o, 0)
    ack(o, 0)
    o.handle(ev.Heartbeat("e0"), 1.0 + o.limits.sync_timeout + 1)
    o.handle(ev.Heartbeat("e1"), 1.0 + o.limits.sync_timeout + 1)
    res = o.handle(ev.Tick(), 1.0 + o.limits.sync_timeout + 2)
    assert o.state == S.IDLE and cmds(res, fsm.CompleteSync)[0].error.code is ErrorCode.TIMEOUT


def test_digest_mismatch_between_engines_fails_not_ready():
    o = to_finalizing()
    finalized(o, "e0", digest="aaa")
    res = finalized(o, "e1", digest="bbb")
    assert o.state == S.IDLE and o.dirty
    assert cmds(res, fsm.CompleteSync)[0].error.code is ErrorCode.ENGINE_FAILED


def test_digest_must_match_trainer_digest():
    o = to_loading()
    o.handle(ev.FinishSync(Finish(sync_id="s1", buckets=1, digest="trainer")), 1.0)
    finalized(o, "e0", digest="engine")
    assert o.state == S.IDLE


def test_canary_mismatch_fails_with_position():
    o = new()
    o.handle(ev.BeginSync(Begin(sync_id="s1", version=1, probes=(Probe((1, 2), 3, (5, 6, 7)),))), 1.0)
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    res = o.handle(
        ev.EngineFinalized("e0", Finalized(sync_id="s1", version=1, digest="d", probes=((5, 9, 7),))), 1.0
    )
    err = cmds(res, fsm.CompleteSync)[0].error
    assert err.code is ErrorCode.CANARY_MISMATCH and err.details["position"] == 1


def test_spec_check_refuses_unknown_tensor_before_forwarding():
    o = Orchestrator(Limits(min_engines=1))
    o.handle(
        ev.EngineRegistered(
            Register(engine_id="e0", backend="torch", spec=(ParamSpec("w", "float32", (4,)),))
        ),
        0.0,
    )
    begin(o, 1)
    bad = (TensorMeta("nope", "float32", (4,), 0, 16),)
    with pytest.raises(WeightSyncError) as ei:
        o.handle(ev.BucketIn(Bucket(sync_id="s1", seq=0, tensors=bad, checksum=0), 16), 1.0)
    assert ei.value.code is ErrorCode.UNKNOWN_TENSOR and not o.sync.buckets
    wrong = (TensorMeta("w", "float32", (2, 2), 0, 16),)
    with pytest.raises(WeightSyncError) as ei:
        o.handle(ev.BucketIn(Bucket(sync_id="s1", seq=0, tensors=wrong, checksum=0), 16), 1.0)
    assert ei.value.code is ErrorCode.SHAPE_MISMATCH
    assert cmds(bucket(o, 0), fsm.ForwardBucket)  # the good one still goes through


def test_every_transition_is_journaled_once():
    o = new()
    journaled = []
    for step in (lambda: begin(o, 1), lambda: bucket(o, 0), lambda: ack(o, 0)):
        r = step()
        journaled += [
            c
            for c in (r.commands if hasattr(r, "commands") else r)
            if isinstance(c, fsm.Journal) and c.kind == "transition"
        ]
    r = finish(o, 1)
    journaled += [c for c in r.commands if isinstance(c, fsm.Journal) and c.kind == "transition"]
    for e in ENGINES:
        journaled += [
            c for c in finalized(o, e).commands if isinstance(c, fsm.Journal) and c.kind == "transition"
        ]
    assert [(j.data["from"], j.data["to"]) for j in journaled] == [
        ("IDLE", "LOADING_BUCKETS"),
        ("LOADING_BUCKETS", "FINALIZING"),
        ("FINALIZING", "READY"),
    ]
    assert [(h["from"], h["to"]) for h in o.history] == [(j.data["from"], j.data["to"]) for j in journaled]


class Model:
    """The spec in a few lines: a sync that completes READY sets the served version and
    clears dirty; one that fails leaves dirty set unless it never touched an engine of a
    READY daemon (then READY again); every ended sync is remembered with its outcome."""

    def __init__(self):
        self.ready_version = None
        self.dirty = False
        self.ended: dict[str, str | None] = {}
        self.touched: set[str] = set()  # syncs that forwarded a bucket or sent a finalize

    def command(self, c):
        if isinstance(c, (fsm.ForwardBucket, fsm.SendFinalize)):
            self.touched.add(c.sync_id)
        elif isinstance(c, fsm.CompleteSync) and c.error is None:
            self.ready_version, self.dirty = c.body["version"], False
            self.ended[c.sync_id] = None
        elif isinstance(c, fsm.CompleteSync):
            back_to_ready = (
                c.sync_id not in self.touched and self.ready_version is not None and not self.dirty
            )
            self.dirty = not back_to_ready
            self.ended[c.sync_id] = c.error.code.value


class RandomOrders(RuleBasedStateMachine):
    """Random message orders never break the invariants."""

    LIMITS: dict = {}  # the core's Limits beyond min_engines

    def __init__(self):
        super().__init__()
        self.o = Orchestrator(Limits(min_engines=len(ENGINES), **self.LIMITS))
        for e in ENGINES:
            self.o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch")), 0.0)
        self.finalize_sent: dict[str, list[str]] = {}
        self.model = Model()
        self.version = 0
        self.now = 1.0

    def _run(self, f):
        before = copy.deepcopy(self.o.snapshot())
        state = self.o.state
        try:
            res = f()
        except WeightSyncError:
            assert self.o.state == state and self.o.snapshot() == before
            return
        for c in res.commands:
            if isinstance(c, fsm.SendFinalize):
                self.finalize_sent.setdefault(c.sync_id, []).append(c.engine_id)
            self.model.command(c)

    @rule(bump=st.integers(-1, 2))
    def do_begin(self, bump):
        v = max(0, self.version + bump)
        self._run(lambda: self.o.handle(ev.BeginSync(Begin(sync_id=f"s{v}", version=v)), self.now))
        if self.o.sync is not None:
            self.version = max(self.version, self.o.sync.version)

    @precondition(lambda self: self.o.sync is None)
    @rule()
    def do_whole_sync(self):
        """A complete sync in one step, so READY (and what follows it) is common."""
        v = self.version + 1
        sid = f"w{v}"
        self._run(lambda: self.o.handle(ev.BeginSync(Begin(sync_id=sid, version=v)), self.now))
        if self.o.sync is None or self.o.sync.sync_id != sid:
            return
        self.version = v
        self._run(
            lambda: self.o.handle(
                ev.BucketIn(Bucket(sync_id=sid, seq=0, tensors=META, checksum=0), 16), self.now
            )
        )
        for e in ENGINES:
            self._run(lambda e=e: self.o.handle(ev.Loaded(e, sid, (0, 0)), self.now))
        self._run(lambda: self.o.handle(ev.FinishSync(Finish(sync_id=sid, buckets=1)), self.now))
        for e in ENGINES:
            self._run(
                lambda e=e: self.o.handle(
                    ev.EngineFinalized(e, Finalized(sync_id=sid, version=v, digest="d")), self.now
                )
            )

    @rule(seq=st.integers(0, 3))
    def do_bucket(self, seq):
        sid = self.o.sync.sync_id if self.o.sync else "none"
        self._run(
            lambda: self.o.handle(
                ev.BucketIn(Bucket(sync_id=sid, seq=seq, tensors=META, checksum=0), 16), self.now
            )
        )

    @rule(seq=st.integers(0, 3), engine=st.sampled_from(ENGINES))
    def do_loaded(self, seq, engine):
        sid = self.o.sync.sync_id if self.o.sync else "none"
        self._run(lambda: self.o.handle(ev.Loaded(engine, sid, (0, seq)), self.now))

    @rule(n=st.integers(0, 4))
    def do_finish(self, n):
        sid = self.o.sync.sync_id if self.o.sync else "none"
        self._run(lambda: self.o.handle(ev.FinishSync(Finish(sync_id=sid, buckets=n)), self.now))

    @rule(engine=st.sampled_from(ENGINES), good=st.booleans())
    def do_finalized(self, engine, good):
        s = self.o.sync
        sid, v = (s.sync_id, s.version) if s else ("none", 1)
        self._run(
            lambda: self.o.handle(
                ev.EngineFinalized(
                    engine, Finalized(sync_id=sid, version=v, digest="d" if good else "other")
                ),
                self.now,
            )
        )

    @rule()
    def do_abort(self):
        sid = self.o.sync.sync_id if self.o.sync else "none"
        self._run(lambda: self.o.handle(ev.AbortSync(sid, "r"), self.now))

    @precondition(lambda self: self.o.sync is not None)
    @rule(engine=st.sampled_from(ENGINES))
    def do_failed(self, engine):
        self._run(
            lambda: self.o.handle(
                ev.EngineFailed(
                    engine, Failed(sync_id=self.o.sync.sync_id, code="ENGINE_FAILED", message="x")
                ),
                self.now,
            )
        )

    @rule()
    def do_heartbeats(self):
        self.now += 1.0
        for e in ENGINES:
            self.o.handle(ev.Heartbeat(e), self.now)

    @rule(past=st.booleans(), heartbeat=st.booleans())
    def do_tick_at_the_next_wake(self, past, heartbeat):
        """Time driven through the core's own next wake: a tick at the float just before it
        changes nothing (the daemon may sleep until then), a tick exactly at it acts."""
        if heartbeat:  # without them the engines' deadline comes first every time
            for e in ENGINES:
                self.o.handle(ev.Heartbeat(e), self.now)
        wake = self.o.next_wake()
        if wake is None:  # no deadline runs: a tick, however late, finds nothing due
            t, acts = self.now + 1e6, False
        elif not past:
            if wake <= self.now:
                return  # due already: there is no "before"
            t, acts = math.nextafter(wake, -math.inf), False
        else:
            t, acts = max(self.now, wake), True
        before = copy.deepcopy(self.o.snapshot())
        out: list = []
        self._run(lambda: out.append(self.o.handle(ev.Tick(), t)) or out[-1])
        changed = self.o.snapshot() != before or bool(out and out[-1].commands)
        assert changed == acts, (wake, t, self.now, before, self.o.snapshot())
        self.now = t

    @invariant()
    def finalize_at_most_once_per_engine_per_sync(self):
        for sid, engines in self.finalize_sent.items():
            assert len(engines) == len(set(engines)), (sid, engines)

    @invariant()
    def core_agrees_with_the_model(self):
        """What the core's outputs said (which syncs completed READY, which failed after
        touching engines) predicts its served version, its dirtiness and every ended id."""
        assert self.o.last_ready_version == self.model.ready_version
        assert self.o.dirty == self.model.dirty
        assert {sid for sid, (code, _) in self.o.ended.items()} == set(self.model.ended)
        for sid, code in self.model.ended.items():
            assert self.o.ended[sid][0] == code

    @invariant()
    def state_matches_sync(self):
        assert (self.o.sync is not None) == (self.o.state in ACTIVE)
        if self.o.state == S.READY:
            assert not self.o.dirty and self.o.served_version is not None

    @precondition(lambda self: self.o.sync is not None)
    @rule()
    def do_trainer_gone(self):
        self._run(lambda: self.o.handle(ev.TrainerGone(self.o.sync.sync_id, 0), self.now))


RandomOrders.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_random_message_orders = RandomOrders.TestCase


class RandomOrdersShortDeadlines(RandomOrders):
    """The same, with the sync's deadlines shorter than the engines' (which heartbeats keep
    far off): a tick at the core's next wake meets each of them in turn."""

    LIMITS = {
        "engine_timeout": 1e5,
        "bucket_timeout": 3.0,
        "sync_timeout": 5.0,
        "finalize_timeout": 4.0,
        "trainer_grace": 2.0,
    }


RandomOrdersShortDeadlines.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
test_random_orders_meet_every_deadline_at_the_next_wake = RandomOrdersShortDeadlines.TestCase


def test_a_move_outside_the_table_is_internal_and_changes_nothing():
    """The table is checked before a state changes: no row takes `finish` from READY."""
    o = to_ready()
    before = _snap(o)
    with pytest.raises(WeightSyncError) as ei:
        o.move(Trigger.FINISH, Outcome.ADVANCE, None)
    assert ei.value.code is ErrorCode.INTERNAL and "no row of the state table" in ei.value.message
    assert o.state == S.READY and _snap(o) == before


def test_every_input_has_one_gate_covering_every_state_and_every_event_names_one():
    """Adding a trigger is one `Trigger`, one gate, its rows and one function: the core's
    one way in knows no event whose trigger has no gate, and a gate names each state at
    most once (taken or ignored; the others are its refusal)."""
    from orchestrator.core import machine
    from orchestrator.core.table import GATES, INPUTS, Trigger

    assert set(GATES) == set(Trigger)
    assert {cls.TRIGGER for cls in machine.HANDLERS} == set(INPUTS)
    for trigger, gate in GATES.items():
        assert not set(gate.take) & set(gate.ignore), trigger
        if set(gate.take) | set(gate.ignore) != set(State):
            assert gate.refusal, f"{trigger}: refused somewhere, with no sentence"


def test_a_move_no_row_takes_is_internal_and_changes_nothing():
    """A trigger function that moves where no row of the state takes its outcome (a
    function written without its row) gets INTERNAL from the table's one executor."""
    from orchestrator.core.table import Trigger

    o = to_ready()
    before = _snap(o)
    for trigger, outcome in ((Trigger.ABORT, Outcome.ADVANCE), (Trigger.HEARTBEAT, Outcome.ADVANCE)):
        with pytest.raises(WeightSyncError) as ei:
            o.move(trigger, outcome, None)
        assert ei.value.code is ErrorCode.INTERNAL and "no row" in ei.value.message
        assert o.state == S.READY and _snap(o) == before


def test_every_refusal_of_a_wrong_state_is_the_tables_gate():
    """The code and sentence a wrong state gets come from GATES, not from the trigger."""
    from orchestrator.core.table import GATES

    checked = 0
    for trigger, gate in GATES.items():
        if trigger.value not in SYNC_TRIGGERS:
            continue  # the others are taken or ignored in every state (the test above)
        for state in State:
            if state in gate.take or state in gate.ignore:
                continue
            o = STATES[state]()
            if trigger == "bucket" and o.sync is None:
                continue  # no sync runs: the bucket names one that does not (UNKNOWN_SYNC)
            before = _snap(o)
            with pytest.raises(WeightSyncError) as ei:
                fire(o, trigger)
            assert ei.value.code is gate.code
            assert ei.value.message.startswith(gate.refusal.format(state=state.value)), ei.value.message
            assert _snap(o) == before
            checked += 1
    assert checked >= 5


def test_an_input_a_state_ignores_changes_nothing():
    """Where a gate says "ignored" the input changes nothing at all, whatever it carries
    (a finalized of the running sync's id arriving in LOADING_BUCKETS, a prepared in
    FINALIZING, ...)."""
    from orchestrator.core.table import GATES

    checked = 0
    for trigger, gate in GATES.items():
        if trigger.value not in SYNC_TRIGGERS:
            continue
        for state in gate.ignore:
            o = STATES[state]()
            before = _snap(o)
            res = fire(o, trigger)
            assert res.commands == [] and res.reply is None, (trigger, state)
            assert _snap(o) == before, (trigger, state)
            checked += 1
    assert checked >= 5


def test_a_daemon_stopping_during_an_untouched_sync_stays_ready():
    """shutdown had no row to READY: stopping a READY daemon while a sync had touched
    nothing raised INTERNAL. The sync ends clean and the daemon stays READY."""
    o = to_ready()
    begin(o, 2)
    o.handle(ev.Shutdown(), 2.0)
    assert o.state == S.READY and not o.dirty and o.served_version == 1
    assert o.history[-1]["trigger"] == "shutdown" and o.history[-1]["to"] == "READY"


def test_every_table_row_is_reachable_by_its_trigger_only():
    """Rows never overlap: one (trigger, source, outcome) each."""
    from orchestrator.core.table import ROWS

    seen = set()
    for r in ROWS:
        for src in r.sources:
            assert (r.trigger, src, r.outcome) not in seen
            seen.add((r.trigger, src, r.outcome))


def test_labelling_engines_are_told_the_version_once_every_participant_finalized_and_ready_waits_for_them():
    """vLLM engines label their outputs: the label moves only at commit (every participant
    finalized), never at an engine's own finalize, which a later failure could undo."""
    o = Orchestrator(Limits(min_engines=2))
    o.handle(ev.EngineRegistered(Register(engine_id="e0", backend="vllm", labels=True)), 0.0)
    o.handle(ev.EngineRegistered(Register(engine_id="e1", backend="torch")), 0.0)
    begin(o, 1)
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    res = finalized(o, "e0")
    assert not cmds(res, fsm.SendCommit)  # e1 has not finalized: nothing is committed yet
    res = finalized(o, "e1")
    assert cmds(res, fsm.SendCommit) == [fsm.SendCommit("e0", "s1", 1)]  # labellers only
    assert o.state == S.FINALIZING  # READY waits for the label
    o.handle(ev.EngineCommitted("e1", Committed(sync_id="s1", version=1, label="1")), 1.0)  # not a labeller
    assert o.state == S.FINALIZING
    res = o.handle(ev.EngineCommitted("e0", Committed(sync_id="s1", version=1, label="1")), 1.0)
    assert o.state == S.READY and cmds(res, fsm.CompleteSync)
    assert {e["engine_id"]: e.get("label") for e in o.snapshot()["engines"]} == {"e0": "1", "e1": None}
    # a failed sync leaves the label where it was; a wrong label fails the sync
    begin(o, 2)
    bucket(o, 0)
    o.handle(ev.AbortSync("s2", "test"), 2.0)
    assert o.engines["e0"].label == "1"
    begin(o, 3)
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    finalized(o, "e0")
    finalized(o, "e1")
    o.handle(ev.EngineCommitted("e0", Committed(sync_id="s3", version=2, label="2")), 3.0)
    assert o.state == S.IDLE and o.last_sync["code"] == "ENGINE_FAILED" and o.dirty


def test_an_engine_that_finalized_without_its_base_is_refused_a_delta_at_begin():
    """A --delta-base engine whose base a sync emptied (vLLM workers that received a
    collective sync themselves) says so in `finalized`: the next delta is refused at
    begin with STALE_BASE naming it, before any engine loads a byte; a later finalize
    with its base held makes deltas possible again."""
    o = Orchestrator(Limits(min_engines=2))
    for e in ENGINES:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="vllm", delta=True)), 0.0)
    to_finalizing(o, 1)
    finalized(o, "e0")
    s = o.sync
    o.handle(
        ev.EngineFinalized(
            "e1", Finalized(sync_id=s.sync_id, version=1, digest="d", finalize_count=1, delta=False)
        ),
        1.0,
    )
    assert o.state == S.READY and not o.engines["e1"].delta and o.engines["e0"].delta
    with pytest.raises(WeightSyncError) as ei:
        o.handle(ev.BeginSync(Begin(sync_id="d2", version=2, base=1)), 2.0)
    assert ei.value.code is ErrorCode.STALE_BASE and "engine e1 keeps no base copy" in ei.value.message
    assert o.state == S.READY and o.sync is None
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)  # dense: the base comes back
    bucket(o, 0)
    ack(o, 0)
    finish(o, 1)
    for e in ENGINES:
        o.handle(
            ev.EngineFinalized(
                e, Finalized(sync_id="s2", version=2, digest="d2", finalize_count=2, delta=True)
            ),
            3.0,
        )
    assert o.state == S.READY and o.engines["e1"].delta
    o.handle(ev.BeginSync(Begin(sync_id="d3", version=3, base=2)), 4.0)
    assert o.state == S.LOADING_BUCKETS
