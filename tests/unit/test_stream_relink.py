"""The trainer's ack loop over the collective when its connection to the daemon comes back
mid-sync (a daemon restart): the buckets in flight are resent to the daemon only (the
engines have their bytes: none is broadcast twice), and a broadcast still waiting on its
group gives up at once rather than waiting out the group's deadline.

A fake connection and group (pure logic of `Stream.run`): the soak once saw a source
stay 120 s in its group's wait after the daemon was killed, because the ack loop had
taken the reconnect and resent every bucket in flight with a second broadcast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from messages import schema
from messages.distgroup import GroupError
from messages.errors import ErrorCode, WeightSyncError
from messages.link import RECONNECTED
from orchestrator.trainer.stream import Stream


class FakeLink:
    reconnected = False

    def pump(self) -> None:
        pass


class FakeGroup:
    """A broadcast completes when waited on, until its members are gone (`dead`): then
    only giving up ends the wait (a real group would wait out its deadline)."""

    planned: dict = {}

    def __init__(self) -> None:
        self.started: list[int] = []
        self.pending_seq: int | None = None
        self.gave_up: list[str] = []
        self.dead = False

    def mac_key(self, sync_id):
        return None

    def start(self, data, seq, give_up=None) -> None:
        self.started.append(seq)
        self.pending_seq = seq

    def wait(self, give_up) -> None:
        if self.pending_seq is None or not self.dead:
            self.pending_seq = None
            return
        why = give_up()
        if why is None:
            raise AssertionError("the group was waited on without giving up: it would wait out its deadline")
        self.gave_up.append(why)
        raise GroupError(f"broadcast abandoned: {why}")


class FakeConn:
    """Its first wait for an ack sees the connection come back (the group's members are
    gone with the old daemon); after that, the daemon acknowledges every header sent."""

    timeout, retries = 20.0, 1

    def __init__(self, group: FakeGroup) -> None:
        self.link = FakeLink()
        self.group = group
        self.sent: list[int] = []
        self.relinked = False
        self.sock = SimpleNamespace(poll=lambda *_: 0)
        self._id = 0

    def new_id(self) -> int:
        self._id += 1
        return self._id

    def send(self, msg, payload=()) -> None:
        self.sent.append(msg.seq)

    def recv(self, timeout: float):
        if not self.relinked:
            self.relinked = self.group.dead = True
            return RECONNECTED
        body = {"seq": self.sent[-1], "source": 0, "through": self.sent[-1]}
        return schema.Ok(id=self._id, body=body)

    def take_replies(self, stop_on):
        return None


def test_a_reconnect_resends_headers_only_and_the_pending_broadcast_gives_up_at_once():
    coll = FakeGroup()
    conn = FakeConn(coll)
    stream = Stream(conn)  # type: ignore[arg-type]
    named = [(f"t{i}", torch.full((1024,), float(i))) for i in range(4)]  # 4 KiB each: a bucket each
    with pytest.raises(WeightSyncError) as ei:
        stream.run("s1", named, 4096, window=2, progress=None, coll=coll)  # type: ignore[arg-type]
    assert ei.value.code is ErrorCode.UNKNOWN_SYNC and "re-established" in ei.value.message
    assert coll.started == sorted(set(coll.started)), coll.started  # no bucket broadcast twice
    assert conn.sent[: len(coll.started)] == coll.started  # each header went with its broadcast
    assert len(conn.sent) > len(coll.started)  # and the ones in flight were sent again
    assert coll.gave_up == ["the connection to the daemon was re-established mid-sync"]
