"""CURVE: only allowlisted keys reach the daemon, per socket role."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time

import pytest

from examples.launch import Cluster
from examples.tiny import perturbed
from messages.buckets import digest
from messages.checksums import bucket_checksum
from messages.errors import ErrorCode, WeightSyncError
from messages.keys import client_keys, generate
from orchestrator.trainer.client import TrainerClient
from tests.integration.helpers import FAST_DAEMON


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator", "keys", "generate", str(d)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_model_dir, keys):
    c = Cluster(
        tmp_path_factory.mktemp("curve"),
        tiny_model_dir,
        engines=1,
        keys=keys,
        daemon_args=FAST_DAEMON,
        engine_args=["--threads", "1", "--heartbeat-interval", "0.5"],
    )
    with c:
        yield c


def refused(cluster, **kw):
    """The handshake's outcome, seen on the client socket's monitor: UNAUTHORIZED within a
    few seconds, while a request timeout (30 s) could not have fired yet."""
    t0 = time.monotonic()
    with TrainerClient(cluster.addr, timeout=30.0, retries=0, **kw) as c:
        with pytest.raises(WeightSyncError) as ei:
            c.status()
    assert time.monotonic() - t0 < 10.0
    return ei.value


def test_generated_secret_keys_are_private_and_roles_are_listed(keys):
    for p in keys.glob("*.key_secret"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert [p.name for p in (keys / "trainers").iterdir()] == ["trainer.key"]
    assert [p.name for p in (keys / "engines").iterdir()] == ["engine.key"]


def test_listed_trainer_pushes_through_listed_engine(secured, tiny_state):
    with secured.client(timeout=30.0) as c:
        w = dict(perturbed(tiny_state, 1))
        r = c.push(w.items(), (c.status()["last_ready_version"] or 0) + 1)
        assert r.state == "READY" and [e["digest"] for e in r.engines] == [digest(w.items())]


def test_the_fanout_publishes_only_to_listed_engines(secured, tiny_state):
    """The fan-out is CURVE like the engine socket: the listed engine subscribes and takes
    the published buckets; a subscriber without keys, or with a trainer's, gets nothing."""
    import zmq

    addr = secured.status()["daemon"]["fanout_addr"]
    subs = []
    for keys in (None, client_keys(secured.keys, "trainer")):
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.apply(sub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(addr)
        subs.append(sub)
    try:
        deadline = time.monotonic() + 20
        while secured.status()["daemon"]["fanout_subscribers"] < 1:  # the listed engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with secured.client(timeout=30.0) as c:
            w = dict(perturbed(tiny_state, 1))
            r = c.push(w.items(), (c.status()["last_ready_version"] or 0) + 1, transport="inline")
            assert r.state == "READY" and [e["digest"] for e in r.engines] == [digest(w.items())]
            assert c.status()["daemon"]["fanout_subscribers"] == 1
        opened = [ln for ln in secured.procs[0].log_path.read_text().splitlines() if "fanout_opened" in ln]
        assert any(r.sync_id in ln for ln in opened)  # the engine took this sync's buckets published
        for sub in subs:
            assert sub.poll(200) == 0  # nothing reached an unlisted subscriber
    finally:
        for sub in subs:
            sub.close(linger=0)


def test_plain_and_unlisted_peers_get_nothing(secured, tmp_path):
    assert refused(secured).code is ErrorCode.UNAUTHORIZED  # no CURVE at all
    generate(tmp_path / "other", ["intruder"], [])
    other = client_keys(tmp_path / "other", "intruder")  # its own server key: wrong server
    assert refused(secured, keys=other).code is ErrorCode.UNAUTHORIZED
    # right server key, unlisted client key
    stolen_server = client_keys(secured.keys, "trainer")
    intruder = type(stolen_server)(stolen_server.server_public, other.public, other.secret)
    assert refused(secured, keys=intruder).code is ErrorCode.UNAUTHORIZED
    # an engine's key is not a trainer's: the trainer socket has its own allowlist
    assert refused(secured, keys=client_keys(secured.keys, "engine")).code is ErrorCode.UNAUTHORIZED
    assert secured.status()["state"] in ("IDLE", "READY")  # and the daemon serves on


def test_unlisted_engine_cannot_register(secured, tmp_path):
    generate(tmp_path / "rogue", [], ["rogue"])
    (tmp_path / "rogue" / "server.key").write_bytes((secured.keys / "server.key").read_bytes())
    p = secured.start_engine("rogue-engine", ["--keys", str(tmp_path / "rogue"), "--key-name", "rogue"])
    try:
        deadline = time.monotonic() + 20
        while "handshake_refused" not in p.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "handshake_refused" in p.log_path.read_text()  # the handshake said no
        t0 = time.monotonic()
        code = p.popen.wait(15)  # it gives up within seconds: the daemon is up and said no
        assert code == 3 and time.monotonic() - t0 < 10.0
        log = p.log_path.read_text()
        assert "refused the security handshake of key 'rogue'" in log and str(tmp_path / "rogue") in log
        ids = [e["engine_id"] for e in secured.status()["engines"]]
        assert "rogue-engine" not in ids and ids == ["engine-0"]
    finally:
        p.stop()


def test_collective_push_keeps_curve_on_the_control_plane(secured, tiny_state):
    """The bytes travel by broadcast, but begin and every bucket's metadata still need an
    allowlisted key: an unlisted trainer cannot even begin a collective sync."""
    with secured.client(timeout=30.0) as c:
        w = dict(perturbed(tiny_state, 7))
        v = (c.status()["last_ready_version"] or 0) + 1
        r = c.push(w.items(), v, transport="collective", bucket_bytes=128 * 1024)
        assert r.detail["transport"] == "collective"
        assert {e["digest"] for e in r.engines} == {digest(w.items())}
    err = refused(secured)  # no keys at all
    assert err.code is ErrorCode.UNAUTHORIZED


def test_with_keys_the_collective_store_is_curve_and_every_bucket_carries_a_mac(
    secured, tiny_state, monkeypatch
):
    """With keys the group's rendezvous store speaks CURVE (its public key and the token
    reach the engine through the daemon's CURVE socket) and each framed bucket carries a
    BLAKE3 MAC keyed per sync: a bucket whose bytes were replaced in flight together with
    a matching xxh3 checksum (what a host writing into gloo's connections can do) is
    refused UNAUTHORIZED before anything is applied; the next push is READY."""
    from messages import stream as wire_stream
    from orchestrator.trainer import stream as trainer_stream

    with secured.client(timeout=30.0) as c:
        v = (c.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        r = c.push(w.items(), v, transport="collective", bucket_bytes=128 * 1024)
        assert r.detail["transport"] == "collective" and c.routes.group is not None
        assert c.routes.group.curve and c.routes.group.mac_key(r.sync_id) is not None
        offer = c.routes.group.offer()
        assert len(offer.store_key) == 40 and len(offer.token) == 64
        status = c.status()
        assert offer.token not in json.dumps(status)  # the secret is never shown
        counts = [e["finalize_count"] for e in status["engines"]]

        real = wire_stream.bucket_mac
        tampered = []

        def tamper(key, h, data, metas):
            tag = real(key, h, data, metas)  # the trainer's own tag, over the bytes it packed
            if h.seq == 1 and not tampered:  # then, in flight: other bytes, a checksum to match
                data[0] ^= 0xFF  # the slot the broadcast sends (data views it)
                object.__setattr__(h, "checksum", bucket_checksum(data, wire_stream.decode_metas(h, metas)))
                tampered.append(h.seq)
            return tag

        monkeypatch.setattr(trainer_stream, "bucket_mac", tamper)
        v += 1
        with pytest.raises(WeightSyncError) as ei:
            c.push(dict(perturbed(tiny_state, v)).items(), v, transport="collective", bucket_bytes=128 * 1024)
        # the checksum matched the replaced bytes: only the MAC can have refused them
        assert tampered == [1]
        assert ei.value.code is ErrorCode.UNAUTHORIZED and "MAC" in ei.value.message, ei.value
        monkeypatch.setattr(trainer_stream, "bucket_mac", real)
        assert [e["finalize_count"] for e in c.status()["engines"]] == counts  # nothing finalized
        w = dict(perturbed(tiny_state, v + 1))
        r = c.push(w.items(), v + 1, transport="collective", bucket_bytes=128 * 1024)
        assert {e["digest"] for e in r.engines} == {digest(w.items())}


def test_keys_generate_adds_an_identity_to_an_existing_directory(tmp_path):
    """The README's way to add a trainer: the same command on the same directory. Exit 0,
    the new identity allowlisted, every existing key left byte for byte."""
    d = tmp_path / "keys"

    def generate_cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "keys", "generate", str(d), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert generate_cli().returncode == 0
    before = {p.name: p.read_bytes() for p in d.rglob("*.key*")}
    r = generate_cli("--trainer", "alice")
    assert r.returncode == 0, r.stderr
    assert (d / "alice.key_secret").is_file() and (d / "trainers" / "alice.key").is_file()
    assert {p.name: p.read_bytes() for p in d.rglob("*.key*") if p.name in before} == before
    assert stat.S_IMODE((d / "alice.key_secret").stat().st_mode) == 0o600
    assert client_keys(d, "alice").public == (d / "trainers" / "alice.key").read_bytes().split(b'"')[1]
