"""Limits: oversized frames and too many pending requests get TOO_LARGE, nothing buffered
without bound, and the daemon goes on serving."""

from __future__ import annotations

import signal

import pytest
import zmq

from examples.tiny import perturbed
from messages import codec, schema
from messages.buckets import iter_buckets
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.helpers import FAST_DAEMON, running_daemon


@pytest.fixture(scope="module")
def limited(tmp_path_factory, tiny_model_dir):
    args = [*FAST_DAEMON, "--max-frame-bytes", "300000", "--max-pending", "2"]
    with running_daemon(tmp_path_factory.mktemp("limits"), tiny_model_dir, daemon_args=args) as c:
        yield c


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_oversized_bucket_is_too_large_and_smaller_buckets_work(limited, tiny_state, transport):
    with limited.client(timeout=20.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        with pytest.raises(WeightSyncError) as ei:
            client.push(dict(perturbed(tiny_state, v)).items(), v, bucket_bytes=1 << 20, transport=transport)
        assert ei.value.code is ErrorCode.TOO_LARGE and "max_frame_bytes" in ei.value.message
        assert client.status()["sync"] is None  # the push aborted its sync; nothing half-applied
        r = client.push(
            dict(perturbed(tiny_state, v)).items(), v, bucket_bytes=64 * 1024, transport=transport
        )
        assert r.state == "READY"


def test_more_pending_requests_than_allowed_are_refused(limited, tiny_state):
    engines = [p for p in limited.procs if p.name.startswith("engine")]
    with limited.client(timeout=20.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        buckets = list(iter_buckets(dict(perturbed(tiny_state, v)).items(), 64 * 1024))
        sid = client.begin(v).sync_id
        for p in engines:
            p.popen.send_signal(signal.SIGSTOP)  # no acks: requests stay pending
        try:
            for i, b in enumerate(buckets[:3]):
                client.conn.send(client.stream.bucket_msg(sid, b, 100 + i), [b.frame()])
            replies = [client.conn.recv(5.0)]
            assert isinstance(replies[0], schema.Error) and replies[0].id == 102
            assert replies[0].code == ErrorCode.TOO_LARGE.value and "max_pending" in replies[0].message
        finally:
            for p in engines:
                p.popen.send_signal(signal.SIGCONT)
        try:  # acknowledgements are cumulative: one reply may answer both (ok {through})
            covered: set[int] = set()
            while covered != {0, 1}:
                m = client.conn.recv(10.0)
                assert isinstance(m, schema.Ok) and m.id in (100, 101), m
                covered |= set(range(m.body.get("through", m.body["seq"]) + 1)) | {m.body["seq"]}
        finally:
            client.abort(sid, "test done")


def test_frame_past_the_hard_limit_drops_that_peer_only(limited):
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(limited.addr)
    header = codec.encode_header(schema.Status(id=7))
    # past 2 x max(max_frame_bytes, max_header_bytes = 16 MiB): ZeroMQ drops the peer unread
    rogue.send_multipart([header, b"x" * (40 << 20)])
    assert rogue.poll(2000) == 0
    rogue.close()
    assert limited.status()["state"] in ("IDLE", "READY")
