"""Typed reply bodies (messages.replies): the begin reply is built by the core alone and
decoded once by the trainer; a body that does not match its type is BAD_MESSAGE."""

from __future__ import annotations

import pytest

from messages.errors import ErrorCode, WeightSyncError
from messages.replies import BeginReply, BucketAck, FinishReply, HeartbeatReply, body, decode
from messages.schema import Begin, Register
from orchestrator.core import Core, Limits
from orchestrator.core import events as ev


def _core(**limits):
    core = Core(Limits(min_engines=1, **limits))
    core.handle(ev.EngineRegistered(Register(engine_id="e0", backend="torch")), 0.0)
    return core


def test_the_begin_reply_carries_each_senders_share_of_the_limits():
    core = _core(max_pending=64, fanout_bytes=192 << 20)
    res = core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, sources=4)), 1.0)
    r = decode(res.reply or {}, BeginReply)
    assert (r.sync_id, r.version, r.state, r.transport) == ("s1", 1, "LOADING_BUCKETS", "inline")
    assert (r.max_pending, r.fanout_bytes, r.engines, r.repeated) == (16, 48 << 20, ("e0",), False)
    again = decode(
        core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, sources=4)), 2.0).reply or {}, BeginReply
    )
    assert again.repeated and again.sync_id == "s1"


def test_without_a_fanout_the_reply_says_so():
    core = _core()
    r = decode(core.handle(ev.BeginSync(Begin(sync_id="s1", version=1)), 1.0).reply or {}, BeginReply)
    assert r.fanout_bytes is None and r.max_pending == 64


def test_a_reply_that_does_not_match_its_type_is_bad_message():
    good = body(BeginReply(sync_id="s", version=1, state="LOADING_BUCKETS"))
    assert decode({**good, "added_by_a_newer_daemon": 1}, BeginReply).version == 1
    for bad in ({**good, "version": "one"}, {k: v for k, v in good.items() if k != "sync_id"}):
        with pytest.raises(WeightSyncError) as ei:
            decode(bad, BeginReply)
        assert ei.value.code is ErrorCode.BAD_MESSAGE and "BeginReply" in ei.value.message


def test_every_input_says_whether_it_is_answered_now_later_or_not_at_all():
    """Result.reply (now), Result.later (with a later command), or neither: the core says,
    the shell does not guess from a missing body."""
    from messages.schema import Bucket, Finish, TensorMeta

    core = _core()
    begun = core.handle(ev.BeginSync(Begin(sync_id="s1", version=1)), 1.0)
    assert begun.reply is not None and not begun.later
    meta = (TensorMeta("w", "float32", (4,), 0, 16),)
    first = core.handle(ev.BucketIn(Bucket(sync_id="s1", seq=0, tensors=meta, checksum=0), 16), 1.0)
    assert first.reply is None and first.later  # acked once the engine applied it
    again = core.handle(ev.BucketIn(Bucket(sync_id="s1", seq=0, tensors=meta, checksum=0), 16), 1.0)
    assert again.reply is None and again.later  # a resend before the engine applied it
    core.handle(ev.Loaded("e0", "s1", (0, 0)), 1.5)
    done = core.handle(ev.BucketIn(Bucket(sync_id="s1", seq=0, tensors=meta, checksum=0), 16), 2.0)
    assert decode(done.reply or {}, BucketAck).duplicate and not done.later
    fin = core.handle(ev.FinishSync(Finish(sync_id="s1", buckets=1, partial=True)), 2.0)
    assert fin.reply is None and fin.later  # with the sync's CompleteSync
    known = core.handle(ev.Heartbeat("e0", registered_here=True), 2.0)
    assert known.reply is None and not known.later  # silence means known
    unknown = core.handle(ev.Heartbeat("zz", registered_here=True), 2.0)
    assert decode(unknown.reply or {}, HeartbeatReply).known is False
    from messages.schema import Finalized

    out = core.handle(ev.EngineFinalized("e0", Finalized(sync_id="s1", version=1, digest="d" * 32)), 3.0)
    (complete,) = [c for c in out.commands if type(c).__name__ == "CompleteSync"]
    r = decode(complete.body or {}, FinishReply)  # the finish's answer, typed
    assert (r.status, r.version, r.digest, r.buckets, r.engine_ids) == ("READY", 1, "d" * 32, 1, ["e0"])
    assert [(e.engine_id, e.digest) for e in r.engines] == [("e0", "d" * 32)] and not r.stream
    assert "stream" not in (complete.body or {}) and "group" not in (complete.body or {})  # unset: left out
    with pytest.raises(WeightSyncError) as ei:
        decode({**(complete.body or {}), "engines": [{"engine_id": "e0"}]}, FinishReply)
    assert ei.value.code is ErrorCode.BAD_MESSAGE


def test_the_status_a_trainer_acts_on_decodes_from_the_cores_snapshot():
    from messages.replies import StatusReply

    core = _core()
    core.handle(ev.EngineRegistered(Register(engine_id="e1", backend="vllm", labels=True)), 0.5)
    st = decode(core.snapshot(1.0), StatusReply)
    assert (st.state, st.version, st.last_ready_version, st.min_engines) == ("IDLE", None, None, 1)
    assert [(e.engine_id, e.state, e.version, e.labels, e.label) for e in st.engines] == [
        ("e0", "STALE", None, False, None),
        ("e1", "STALE", None, True, None),  # labels outputs, none set yet
    ]
    with pytest.raises(WeightSyncError) as ei:
        decode({**core.snapshot(1.0), "engines": [{"state": "READY"}]}, StatusReply)  # no engine_id
    assert ei.value.code is ErrorCode.BAD_MESSAGE
