"""End to end: a real daemon, real torch engine subprocesses, the real client."""

from __future__ import annotations

import itertools

import msgpack
import pytest
import zmq

from engines.torch_engine import greedy, load_model
from examples.tiny import perturbed
from messages import codec, schema
from messages.buckets import digest, iter_buckets
from messages.errors import DataError, ErrorCode, StateError
from messages.schema import PROTOCOL_VERSION, Probe

from .helpers import running_daemon

PROMPTS = [(1, 17, 42, 99), (1, 250, 3)]


def expected_probes(model_dir, weights):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return [Probe(p, 6, greedy(m, p, 6)) for p in PROMPTS]


def test_three_versions_reach_every_engine_finalized_once_each(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir) as cluster, cluster.client() as client:
        for v in (1, 2, 3):
            weights = dict(perturbed(tiny_state, v))
            probes = expected_probes(tiny_model_dir, weights)
            r = client.push(weights.items(), v, bucket_bytes=256 * 1024, probes=probes)
            assert r.state == "READY" and r.version == v and r.buckets > 1
            assert r.digest == digest(weights.items())
            assert sorted(e["engine_id"] for e in r.engines) == ["engine-0", "engine-1"]
            for e in r.engines:
                assert e["digest"] == r.digest
                assert [tuple(p) for p in e["probes"]] == [p.expected for p in probes]
                # each engine says where its time went: hashing, loading, finalize, canary
                assert {"begin", "checksum", "load", "finalize", "canary"} <= set(e["phases"])
                assert all(s >= 0 for s in e["phases"].values())
            assert 2 <= r.detail["window"] <= 8  # sized from measurements (window=None)
            assert {"pack", "send", "wait_acks", "finish"} <= set(r.detail["trainer_phases"])
        st = client.status()
    assert st["state"] == "READY" and st["version"] == 3 and st["dirty"] is False
    # no bucket frame outlives its forwarding (they travel with the core's commands only)
    assert st["queues"]["pending_buckets"] == 0
    assert [(e["engine_id"], e["finalize_count"], e["version"]) for e in st["engines"]] == [
        ("engine-0", 3, 3),
        ("engine-1", 3, 3),
    ]
    trans = [(h["from"], h["to"]) for h in st["history"]]
    assert (
        trans
        == [("IDLE", "LOADING_BUCKETS"), ("LOADING_BUCKETS", "FINALIZING"), ("FINALIZING", "READY")]
        + [("READY", "LOADING_BUCKETS"), ("LOADING_BUCKETS", "FINALIZING"), ("FINALIZING", "READY")] * 2
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with running_daemon(tmp_path_factory.mktemp("cluster"), tiny_model_dir) as c:
        yield c


_versions = itertools.count(100)


@pytest.fixture()
def client(cluster):
    """A client of the module's daemon; whatever sync a test leaves running (a failed
    assertion mid-sync) is aborted, so the next test, in any order, can begin."""
    with cluster.client(timeout=20.0, retries=1) as c:
        yield c
        running = c.status().get("sync")
        if running:
            c.abort(running["sync_id"], "test teardown")


def one_bucket(tiny_state, v):
    weights = dict(perturbed(tiny_state, v))
    (b,) = list(iter_buckets(weights.items(), 64 << 20))
    return weights, b


def test_second_finish_is_rejected_with_state_and_version(client, tiny_state):
    v = next(_versions)
    weights, b = one_bucket(tiny_state, v)
    sid = client.begin(v).sync_id
    client.send_bucket(sid, b)
    client.finish(sid, 1, digest=digest(weights.items()))
    with pytest.raises(StateError) as ei:
        client.finish(sid, 1)
    err = ei.value
    assert err.code is ErrorCode.INVALID_STATE
    assert (err.state, err.version) == ("READY", v)
    assert "READY" in err.message


def test_finish_with_missing_buckets_is_incomplete_then_retry_succeeds(client, tiny_state):
    v = next(_versions)
    weights = dict(perturbed(tiny_state, v))
    buckets = list(iter_buckets(weights.items(), 256 * 1024))
    assert len(buckets) >= 2
    sid = client.begin(v).sync_id
    client.send_bucket(sid, buckets[0])
    with pytest.raises(StateError) as ei:
        client.finish(sid, len(buckets))
    assert ei.value.code is ErrorCode.INCOMPLETE_SYNC and ei.value.state == "LOADING_BUCKETS"
    for b in buckets[1:]:
        client.send_bucket(sid, b)
    client.send_bucket(sid, buckets[0])  # a resend is acknowledged, not re-applied
    body = client.finish(sid, len(buckets), digest=digest(weights.items()))
    assert body.status == "READY" and body.version == v


def test_older_version_is_stale(client, tiny_state):
    v = next(_versions)
    client.push(dict(perturbed(tiny_state, v)).items(), v)
    for old in (v, v - 50):
        with pytest.raises(StateError) as ei:
            client.begin(old)
        assert ei.value.code is ErrorCode.STALE_VERSION and ei.value.version == v
    assert client.status()["state"] == "READY"


def test_corrupted_frame_is_refused_and_nothing_applied(client, tiny_state):
    v = next(_versions)
    served = client.status()
    weights, b = one_bucket(tiny_state, v)
    sid = client.begin(v).sync_id
    raw = bytearray(b.frame())
    raw[len(raw) // 2] ^= 0x40
    rid = 9_000_001
    client.conn.send(client.stream.bucket_msg(sid, b, rid), [bytes(raw)])
    reply = client.conn.recv(10.0)
    assert isinstance(reply, schema.Error) and reply.code == "CHECKSUM_MISMATCH"
    st = client.status()
    assert st["state"] == "LOADING_BUCKETS" and st["sync"]["buckets"] == 0
    # engines still hold what they held: nothing was forwarded
    assert [e["digest"] for e in st["engines"]] == [e["digest"] for e in served["engines"]]
    client.send_bucket(sid, b)  # the trainer retries the same seq with good bytes
    body = client.finish(sid, 1, digest=digest(weights.items()))
    assert body.digest == digest(weights.items())


def test_garbage_bytes_get_bad_message_and_daemon_keeps_serving(cluster, client):
    before = client.status()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(cluster.addr)
    try:
        cases = [
            [b"\x00\xffnot msgpack"],
            [msgpack.packb([1, 2, 3])],
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "type": "bucket",
                        "id": 5,
                        "sync_id": "x",
                        "seq": 0,
                        "checksum": 0,
                        "tensors": [],
                    }
                )
            ],  # no payload frame
            [msgpack.packb({"v": 99, "type": "status", "id": 6})],
            [
                msgpack.packb(
                    {"v": PROTOCOL_VERSION, "type": "register", "id": 7, "engine_id": "x", "backend": "y"}
                )
            ],
        ]  # an engine message on the trainer socket: WRONG_SOCKET, naming the engine socket
        codes = []
        for frames in cases:
            raw.send_multipart(frames)
            assert raw.poll(5000), "daemon did not answer"
            reply = codec.decode(raw.recv_multipart()).msg
            assert isinstance(reply, schema.Error)
            codes.append(reply.code)
        assert codes == ["BAD_MESSAGE", "BAD_MESSAGE", "BAD_MESSAGE", "UNSUPPORTED_PROTOCOL", "WRONG_SOCKET"]
    finally:
        raw.close(0)
    after = client.status()
    assert (after["state"], after["version"]) == (before["state"], before["version"])
    errors = after["daemon"]["errors"]
    assert errors["BAD_MESSAGE"] - before["daemon"]["errors"].get("BAD_MESSAGE", 0) == 3
    assert errors["WRONG_SOCKET"] - before["daemon"]["errors"].get("WRONG_SOCKET", 0) == 1


def test_unknown_tensor_is_refused_before_fan_out(client, tiny_state):
    import torch

    if client.status()["state"] != "READY":  # this test ran first in the module
        client.push(dict(perturbed(tiny_state, 1)).items(), next(_versions))
    v = next(_versions)
    before = client.status()
    sid = client.begin(v).sync_id
    (bad,) = list(iter_buckets([("model.bogus.weight", torch.zeros(8))]))
    with pytest.raises(DataError) as ei:
        client.send_bucket(sid, bad)
    assert ei.value.code is ErrorCode.UNKNOWN_TENSOR
    client.abort(sid, "test done")
    st = client.status()
    # untouched: nothing reached an engine, so the abort leaves READY at the served version
    assert (st["state"], st["version"], st["dirty"]) == ("READY", before["version"], False)


def test_push_failure_aborts_and_daemon_takes_the_next_version(client, tiny_state):
    import torch

    v = next(_versions)
    weights = dict(perturbed(tiny_state, v))
    weights["model.norm.weight"] = torch.zeros(7)  # wrong shape: refused
    with pytest.raises(DataError) as ei:
        client.push(weights.items(), v, bucket_bytes=64 * 1024)
    assert ei.value.code is ErrorCode.SHAPE_MISMATCH
    st = client.status()
    assert st["sync"] is None and st["state"] in ("READY", "IDLE")
    good = dict(perturbed(tiny_state, v))
    assert client.push(good.items(), v).digest == digest(good.items())


def test_status_json_has_the_documented_fields(client):
    st = client.status()
    assert st["state"] in ("IDLE", "LOADING_BUCKETS", "FINALIZING", "READY")
    assert isinstance(st["dirty"], bool) and "version" in st and "sync" in st
    for e in st["engines"]:
        assert {"engine_id", "backend", "state", "version", "finalize_count"} <= set(e)
    for h in st["history"]:
        assert {"from", "to", "trigger", "version", "at"} <= set(h)
        assert h["at"] > 1.6e9  # wall-clock seconds


def test_window_keeps_at_most_window_buckets_unacknowledged(cluster, tiny_state):
    """The client never has more than `window` buckets in flight (memory stays flat)."""
    v = next(_versions)
    weights = dict(perturbed(tiny_state, v))
    with cluster.client(timeout=20.0) as c:
        events: list[str] = []
        orig = c.conn.send

        def spy(msg, payload=()):
            if msg.TYPE == "bucket":
                events.append("send")
            orig(msg, payload)

        c.conn.send = spy
        r = c.push(
            weights.items(), v, bucket_bytes=32 * 1024, window=2, progress=lambda n: events.append("ack")
        )
    assert r.buckets == events.count("send") == events.count("ack") > 4
    in_flight = peak = 0
    for ev in events:
        in_flight += 1 if ev == "send" else -1
        peak = max(peak, in_flight)
    assert peak == 2
