"""Inline and shared-memory transports: same weights either way, mixed engines, no leaks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from examples.tiny import perturbed
from messages import schema
from messages.buckets import digest, iter_buckets
from messages.errors import ErrorCode, PeerError, WeightSyncError
from messages.segments import list_segments

from .helpers import STALLING_TRAINER, running_daemon


def trainer_segments(pid: int | None = None):
    """The trainer segments of process `pid` (this test process by default): another
    suite's trainers on the same machine have their own."""
    mine = f"weightsync.trainer.{os.getpid() if pid is None else pid}."
    return [s for s in list_segments() if s.startswith(mine)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with running_daemon(tmp_path_factory.mktemp("transports"), tiny_model_dir) as c:
        yield c


def test_inline_and_shm_deliver_the_same_weights_and_leave_no_segments(cluster, tiny_state):
    rings = []
    with cluster.client() as client:
        base = client.status()["last_ready_version"] or 0
        for i, transport in enumerate(("inline", "shm", "auto", "shm")):
            v = base + 1 + i
            w = dict(perturbed(tiny_state, v))
            r = client.push(w.items(), v, bucket_bytes=128 * 1024, transport=transport)
            want = "inline" if transport == "inline" else "shm"
            assert r.detail["transport"] == want
            assert {e["digest"] for e in r.engines} == {digest(w.items())}
            rings.append(sorted(trainer_segments()))
    # the slots are reserved once and reused by the client's later pushes, then released
    assert rings[0] == [] and rings[1] and rings[1] == rings[2] == rings[3]
    assert not trainer_segments()


@pytest.mark.parametrize("transport", ["inline", "shm", "collective"])
def test_each_pass_over_the_bytes_reports_the_bytes_its_own_loop_went_over(cluster, tiny_state, transport):
    """The trainer's copy and hash and every engine's hash count the bytes they went over
    as they do it (what bench.vllm reports): each of the model's bytes once, padding never;
    a tensor larger than a bucket (inline and shm split it) is hashed a second time by the
    trainer (its pieces' parts, then its own digest part) and copied and hashed a second
    time by each engine as it is assembled ("assemble")."""
    with cluster.client() as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        w = dict(perturbed(tiny_state, v))
        n = sum(t.numel() * t.element_size() for t in w.values())
        r = client.push(w.items(), v, bucket_bytes=128 * 1024, transport=transport)
    big = sum(nb for t in w.values() if (nb := t.numel() * t.element_size()) > 128 * 1024)
    split = big if transport != "collective" else 0
    assert r.detail["transport"] == transport and r.buckets > 1 and big > 0
    assert r.detail["trainer_pass_bytes"] == {"pack_copy": n, "pack_hash": n + split}
    engine = {"checksum": n, "assemble": split} if split else {"checksum": n}
    assert [e["pass_bytes"] for e in r.engines] == [engine] * 2


def test_shm_bucket_without_negotiation_is_refused(cluster, tiny_state):
    with cluster.client() as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        sid = client.begin(v, transport="inline").sync_id
        (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, v)).items(), 128 * 1024))
        with pytest.raises(PeerError) as ei:
            client.conn.request(
                lambda i: client.stream.bucket_msg(
                    sid, b, i, ref=schema.Ref("weightsync.trainer.1.0123456789ab", 0, b.nbytes)
                )
            )
        assert ei.value.code is ErrorCode.BAD_MESSAGE and "negotiate" in ei.value.message
        client.abort(sid)


def test_corrupted_shm_slot_fails_the_sync_with_checksum_mismatch(cluster, tiny_state):
    from messages.segments import Segment

    with cluster.client(timeout=20.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        started = client.begin(v, transport="shm")
        assert started.transport == "shm"
        (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, v)).items(), 128 * 1024))
        with Segment(b.nbytes, kind="trainer") as seg:
            raw = bytearray(b.frame())
            raw[5] ^= 0x10
            seg.write(bytes(raw))
            with pytest.raises(WeightSyncError) as ei:
                client.conn.request(
                    lambda i: client.stream.bucket_msg(
                        started.sync_id, b, i, ref=schema.Ref(seg.name, 0, b.nbytes)
                    )
                )
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH
        st = client.status()
        assert st["state"] == "IDLE" and st["dirty"] is True
        w = dict(perturbed(tiny_state, v + 1))
        assert client.push(w.items(), v + 1).state == "READY"


def test_engine_without_shm_gets_inline_frames_in_a_mixed_sync(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir, engines=1, min_engines=2) as cluster:
        cluster.start_engine("engine-inline", ["--no-shm"])
        cluster.wait_engines(2)
        with cluster.client() as client:
            w = dict(perturbed(tiny_state, 1))
            r = client.push(w.items(), 1, bucket_bytes=128 * 1024, transport="auto")
            assert r.detail["transport"] == "mixed"
            assert {e["digest"] for e in r.engines} == {digest(w.items())} and len(r.engines) == 2
            engines = {e["engine_id"]: e["transports"] for e in client.status()["engines"]}
            assert "shm" not in engines["engine-inline"] and "shm" in engines["engine-0"]
        assert not trainer_segments()


def test_trainer_killed_mid_sync_leaves_no_segment_behind(tmp_path, tiny_model_dir):
    """SIGKILL of a trainer mid-sync: the daemon sees its connection close and ends the sync
    within seconds (not --sync-timeout, left at 300 s), and sweeps its segments."""
    args = ["--engine-timeout", "5"]
    with running_daemon(tmp_path, tiny_model_dir, daemon_args=args) as cluster:
        p = subprocess.Popen(
            [sys.executable, "-c", STALLING_TRAINER, cluster.addr, str(tiny_model_dir), "1", "shm"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "STREAMING"
        assert trainer_segments(p.pid)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and cluster.status()["state"] != "IDLE":
            time.sleep(0.2)
        last = cluster.status()["last_sync"]
        assert last["code"] == "ABORTED" and "connection closed" in last["reason"], last
        # The sweep is one of the ended sync's effects, which follow its journal write: the
        # state is IDLE a moment before; give the effects the same bounded wait.
        leftover = trainer_segments(p.pid)
        while leftover and time.monotonic() < deadline:
            time.sleep(0.1)
            leftover = trainer_segments(p.pid)
        assert not leftover  # swept by the daemon


def fanout_opens(cluster) -> list[dict]:
    lines = cluster.procs[0].log_path.read_text(errors="replace").splitlines()
    return [d for d in map(_json, lines) if d.get("event") == "fanout_opened"]


def _json(line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError:
        return {}


def test_each_bucket_is_published_once_per_kind_for_every_engine(tmp_path, tiny_model_dir, tiny_state):
    """Two engines read shared memory, one takes frames: each bucket goes out once by
    reference and once with its bytes, not once per engine; all three end on one digest."""
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=3) as cluster:
        cluster.start_engine("engine-inline", ["--no-shm"])
        cluster.wait_engines(3)
        with cluster.client() as client:
            deadline = time.monotonic() + 20
            while client.status()["daemon"]["fanout_subscribers"] < 3:
                assert time.monotonic() < deadline, client.status()["daemon"]
                time.sleep(0.05)
            for v, transport, kinds in ((1, "auto", 2), (2, "inline", 1)):
                w = dict(perturbed(tiny_state, v))
                before = client.status()["daemon"]
                r = client.push(w.items(), v, bucket_bytes=16 * 1024, transport=transport)
                after = client.status()["daemon"]
                sent = after["messages_sent"] - before["messages_sent"]
                published = after["messages_published"] - before["messages_published"]
                assert r.detail["transport"] == ("mixed" if transport == "auto" else "inline")
                assert {e["digest"] for e in r.engines} == {digest(w.items())} and len(r.engines) == 3
                # every bucket published once per kind (shm by reference, inline with its
                # bytes) after the sync's open, none sent to an engine one by one: what is not
                # published is the trainer's acks and, per engine, finalize and its replies
                assert r.buckets > 10 and published == kinds * r.buckets + 1, (published, r.buckets)
                assert sent - published <= r.buckets + 2 * 3 + 4, (sent, published, r.buckets)
        opens = fanout_opens(cluster)
        assert [(o["frames"], o["refs"]) for o in opens] == [(1, 2), (3, 0)], opens
