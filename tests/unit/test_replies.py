"""Typed reply bodies (messages.replies): the begin reply is built by the core alone and
decoded once by the trainer; a body that does not match its type is BAD_MESSAGE."""

from __future__ import annotations

import pytest

from messages.errors import ErrorCode, WeightSyncError
from messages.replies import BeginReply, body, decode
from messages.schema import Begin, Register
from orchestrator.core import Core, Limits
from orchestrator.core import events as ev


def _core(**limits):
    core = Core(Limits(min_engines=1, **limits))
    core.handle(ev.EngineRegistered(Register(engine_id="e0", backend="torch")), 0.0)
    return core


def test_the_begin_reply_carries_each_senders_share_of_the_limits():
    core = _core(max_pending=64, fanout_bytes=192 << 20)
    res = core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, senders=4)), 1.0)
    r = decode(res.reply or {}, BeginReply)
    assert (r.sync_id, r.version, r.state, r.transport) == ("s1", 1, "LOADING_BUCKETS", "inline")
    assert (r.max_pending, r.fanout_bytes, r.engines, r.repeated) == (16, 48 << 20, ("e0",), False)
    again = decode(
        core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, senders=4)), 2.0).reply or {}, BeginReply
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
