"""Hostile but well-formed input against a live daemon holding a registered engine and an
open sync: every case gets a typed error within a second, the daemon answers `status`
right after, the sync is as it was, and no file outside the spool changes."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from examples.launch import Cluster
from messages import schema
from messages.errors import ErrorCode
from messages.schema import PROTOCOL_VERSION

from .scripted import HOST, Peer, ScriptedEngine, bucket_frames

pytestmark = pytest.mark.slow


def tree(root: Path, skip: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Every file under `root` (but the daemon's own spool, logs and journal): size, mtime."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if rel.parts[0] in skip or p.is_dir():
            continue
        st = p.lstat()
        out[str(rel)] = (st.st_size, st.st_mtime_ns)
    return out


class World:
    def __init__(self, c, eng, trainer, tmp_path, shm_dir):
        self.c, self.eng, self.trainer, self.tmp_path, self.shm_dir = c, eng, trainer, tmp_path, shm_dir

    def __iter__(self):
        return iter((self.c, self.eng, self.trainer, self.tmp_path, self.shm_dir))

    def snapshot(self):
        self.before = tree(self.tmp_path, ("d",))


@pytest.fixture
def world(tmp_path):
    """A daemon with a spool and a private shm dir, one scripted engine, a sync loading."""
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("must survive")
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    c = Cluster(
        tmp_path / "d",
        None,
        engines=0,
        min_engines=1,
        daemon_args=[
            "--spool",
            str(tmp_path / "d" / "spool"),
            "--shm-dir",
            str(shm_dir),
            "--engine-timeout",
            "30",
            "--log-level",
            "warning",
        ],
    )
    with c:
        eng = ScriptedEngine(c.engine_addr, transports=("inline", "shm"))
        trainer = Peer(c.addr)
        ok = trainer.request(schema.Begin(sync_id="good-1", version=1, id=1, transport="shm", host=HOST))
        assert isinstance(ok, schema.Ok) and ok.body["transport"] == "shm", ok
        w = World(c, eng, trainer, tmp_path, shm_dir)
        w.snapshot()
        yield w
        assert tree(tmp_path, ("d",)) == w.before  # no file outside the daemon's own changed
        assert (tmp_path / "victim" / "keep.txt").read_text() == "must survive"
        eng.close()
        trainer.close()


def refused_fast(peer: Peer, header: dict | schema.Message, payload=(), codes=(ErrorCode.BAD_MESSAGE,)):
    t0 = time.monotonic()
    if isinstance(header, schema.Message):
        peer.send(header, payload)
    else:
        peer.send_raw({"v": PROTOCOL_VERSION, "id": 7, **header}, payload)
    reply = peer.recv_type(schema.Error, timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    assert reply.code in {c.value for c in codes}, reply
    return reply


def still_serving(c: Cluster, sync_id: str = "good-1") -> dict:
    st = c.status(timeout=1.0)
    assert st["state"] == "LOADING_BUCKETS" and st["sync"]["sync_id"] == sync_id, st
    return st


PATH_IDS = [
    "../victim",
    "../../victim",
    "a/b",
    "/etc",
    "a\x00b",
    ".hidden",
    "-x",
    "x" * 129,
    "",
    "..",
    "victim\n",
    "ü",
]


def test_path_like_nul_and_odd_ids_never_reach_a_path(world):
    c, eng, trainer, tmp_path, _ = world
    for bad in PATH_IDS:
        for header in (
            {"type": "abort", "sync_id": bad},
            {"type": "begin", "sync_id": bad, "version": 9},
            {"type": "finish", "sync_id": bad, "buckets": 0},
        ):
            r = refused_fast(trainer, header)
            assert "sync_id" in r.message
        refused_fast(eng, {"type": "register", "engine_id": bad, "backend": "torch"})
        refused_fast(eng, {"type": "loaded", "sync_id": bad, "seq": 0})
        still_serving(c)
    assert (tmp_path / "victim").is_dir()


@pytest.mark.parametrize(
    "field,value",
    [
        ("version", 2**63),
        ("version", 2**64 - 1),
        ("version", -1),
        ("expected_buckets", 2**40),
        ("sources", 0),
        ("sources", 2**20),
    ],
)
def test_out_of_range_begin_fields_are_refused_before_any_effect(world, field, value):
    c, _, trainer, _, _ = world
    r = refused_fast(trainer, {"type": "begin", "sync_id": "other", "version": 2, field: value})
    assert field in r.message
    still_serving(c)


def test_out_of_range_integers_on_both_sockets(world):
    c, eng, trainer, _, _ = world
    bucket, frame = bucket_frames("good-1")
    raw = {
        "type": "bucket",
        "sync_id": "good-1",
        "tensors": [t.to_wire() for t in bucket.tensors],
        "checksum": bucket.checksum,
    }
    for field, value in (("seq", 2**40), ("seq", -1), ("source", 2**20), ("checksum", -5)):
        r = refused_fast(trainer, {**raw, "seq": 0, field: value}, (frame,))
        assert field in r.message
    refused_fast(trainer, {"type": "finish", "sync_id": "good-1", "buckets": 2**63})
    for header in (
        {"type": "loaded", "sync_id": "good-1", "seq": 2**40},
        {"type": "finalized", "sync_id": "good-1", "version": 2**64 - 1, "digest": "ab"},
        {"type": "failed", "sync_id": "good-1", "code": "X", "message": "m", "seq": -3},
        {"type": "register", "engine_id": "e9", "backend": "t", "pid": 2**40},
        {"type": "register", "engine_id": "e9", "backend": "t", "finalize_count": 2**63},
        {"type": "loaded", "sync_id": "good-1", "seq": 0, "seconds": 1e300},
    ):
        refused_fast(eng, header)
    still_serving(c)
    st = c.status()
    assert [e["engine_id"] for e in st["engines"]] == ["scripted-0"]  # nothing registered


def _bucket_at(name: str) -> tuple[schema.Bucket, bytes]:
    bucket, frame = bucket_frames("good-1")
    return schema.Bucket(
        sync_id="good-1",
        seq=0,
        tensors=bucket.tensors,
        checksum=bucket.checksum,
        ref=schema.Ref(name, 0, 16),
    ), frame


def test_shm_names_that_are_fifos_symlinks_foreign_or_short_are_refused(world):
    c, eng, trainer, tmp_path, shm_dir = world
    fifo = "weightsync.trainer.1.0000000000aa"
    os.mkfifo(shm_dir / fifo)
    link = "weightsync.trainer.1.0000000000bb"
    (tmp_path / "victim" / "target.bin").write_bytes(b"\0" * 4096)
    os.symlink(tmp_path / "victim" / "target.bin", shm_dir / link)
    short = "weightsync.trainer.1.0000000000cc"
    (shm_dir / short).write_bytes(b"\0" * 8)
    foreign = "weightsync.trainer.1.0000000000dd"
    (shm_dir / foreign).write_bytes(b"\0" * 4096)
    if os.geteuid() == 0:
        os.chown(shm_dir / foreign, 65534, 65534)
    missing = "weightsync.trainer.1.0000000000ee"
    world.snapshot()  # the files this test planted are the baseline
    cases = {fifo: "regular file", link: "cannot be opened", short: "need 16", missing: "does not exist"}
    if os.geteuid() == 0:
        cases[foreign] = "owned by uid 65534"
    for name, why in cases.items():
        msg, _ = _bucket_at(name)
        r = refused_fast(trainer, msg)
        assert why in r.message, (name, r.message)
        still_serving(c)
    for name in (
        "../victim/target.bin",
        "weightsync.trainer.1.0000000000aa/..",
        "/etc/passwd",
        "weightsync.trainer.1.0000000000AA",
    ):
        bucket, _ = bucket_frames("good-1")
        header = {
            "type": "bucket",
            "sync_id": "good-1",
            "seq": 0,
            "checksum": bucket.checksum,
            "tensors": [t.to_wire() for t in bucket.tensors],
            "shm": {"name": name, "offset": 0, "size": 16},
        }
        r = refused_fast(trainer, header)
        assert "shm.name" in r.message
    still_serving(c)
    # the sync is intact: a good bucket still goes through
    msg, frame = bucket_frames("good-1")
    trainer.send(msg, (frame,))
    eng.ack_load()
    assert isinstance(trainer.recv_type(schema.Ok), schema.Ok)


def test_oversized_strings_and_lists_are_refused(world):
    c, eng, trainer, _, _ = world
    refused_fast(trainer, {"type": "begin", "sync_id": "s" * 10_000, "version": 5})
    refused_fast(trainer, {"type": "abort", "sync_id": "good-1", "reason": "r" * 100_000})
    refused_fast(
        trainer,
        {"type": "begin", "sync_id": "p", "version": 5, "probes": [{"prompt": [1], "max_tokens": 1}] * 1000},
    )
    refused_fast(
        trainer,
        {"type": "begin", "sync_id": "p", "version": 5, "probes": [{"prompt": [1] * 5000, "max_tokens": 1}]},
    )
    bucket, _ = bucket_frames("good-1")
    meta = bucket.tensors[0].to_wire()
    refused_fast(
        trainer,
        {
            "type": "bucket",
            "sync_id": "good-1",
            "seq": 0,
            "checksum": 0,
            "tensors": [{**meta, "name": "n" * 5000}],
        },
        (b"\0" * 16,),
    )
    many = [{**meta, "name": f"t{i}"} for i in range(70_000)]
    refused_fast(
        trainer,
        {"type": "bucket", "sync_id": "good-1", "seq": 0, "checksum": 0, "tensors": many},
        (b"\0" * 16,),
        codes=(ErrorCode.TOO_LARGE,),
    )
    refused_fast(
        trainer,
        {
            "type": "bucket",
            "sync_id": "good-1",
            "seq": 0,
            "checksum": 0,
            "tensors": [{**meta, "shape": [1] * 40}],
        },
        (b"\0" * 16,),
    )
    refused_fast(eng, {"type": "failed", "sync_id": "good-1", "code": "X", "message": "m" * 100_000})
    refused_fast(
        eng, {"type": "register", "engine_id": "big", "backend": "t", "transports": ["inline"] * 100}
    )
    still_serving(c)


def test_begin_ok_is_only_sent_once_the_journal_has_it(world):
    c, _, _, _, _ = world
    db = sqlite3.connect(c.state_db)
    rows = db.execute("SELECT dst, sync_id FROM transitions ORDER BY id").fetchall()
    assert ("LOADING_BUCKETS", "good-1") in rows  # the fixture's begin was answered ok
    assert db.execute("SELECT status FROM syncs WHERE sync_id='good-1'").fetchone() == ("LOADING_BUCKETS",)


def test_a_bug_in_an_engine_handler_fails_the_sync_with_internal_and_the_daemon_serves_on(tmp_path):
    c = Cluster(
        tmp_path,
        None,
        engines=0,
        min_engines=1,
        daemon_args=["--failpoint", "crash_on_loaded=1", "--log-level", "error"],
    )
    with c:
        eng = ScriptedEngine(c.engine_addr)
        trainer = Peer(c.addr)
        assert isinstance(trainer.request(schema.Begin(sync_id="b1", version=1)), schema.Ok)
        msg, frame = bucket_frames("b1")
        trainer.send(msg, (frame,))
        eng.ack_load()  # the daemon's handler of this `loaded` raises
        err = trainer.recv_type(schema.Error, timeout=2.0)
        assert err.code == "INTERNAL" and "failpoint crash_on_loaded" in err.message
        st = c.status(timeout=1.0)
        assert st["sync"] is None and st["last_sync"]["code"] == "INTERNAL"
        # and the next sync works end to end
        assert isinstance(trainer.request(schema.Begin(sync_id="b2", version=2)), schema.Ok)
        msg, frame = bucket_frames("b2", value=2.0)
        trainer.send(msg, (frame,))
        eng.ack_load()
        assert isinstance(trainer.recv_type(schema.Ok), schema.Ok)
        trainer.send(schema.Finish(sync_id="b2", buckets=1))
        eng.finalize(digest="0f")
        done = trainer.recv_type(schema.Ok, timeout=5.0)
        assert done.body["status"] == "READY" and done.body["version"] == 2
        eng.close()
        trainer.close()


def test_a_trainer_cannot_send_buckets_or_finish_into_the_daemons_own_rollback(tmp_path):
    """A rollback's buckets come from the spool and its finish from the daemon: a trainer's
    bucket there once stood as a second bucket, the daemon's finish (one bucket) never
    matched, and the rollback hung until --bucket-timeout. Now refused, the rollback
    unchanged and completing."""
    c = Cluster(
        tmp_path,
        None,
        engines=0,
        min_engines=1,
        daemon_args=["--spool", str(tmp_path / "spool"), "--log-level", "error"],
    )
    with c:
        eng = ScriptedEngine(c.engine_addr)
        trainer = Peer(c.addr)
        for version, fails in ((1, False), (2, True)):
            sid = f"r{version}"
            assert isinstance(trainer.request(schema.Begin(sync_id=sid, version=version)), schema.Ok)
            msg, frame = bucket_frames(sid, value=float(version))
            trainer.send(msg, (frame,))
            eng.ack_load(sync_id=sid)
            assert isinstance(trainer.recv_type(schema.Ok), schema.Ok)
            if fails:  # the engine fails after applying it: the fleet is dirty, a rollback opens
                eng.send(schema.Failed(sync_id=sid, code="ENGINE_FAILED", message="test"))
            else:
                trainer.send(schema.Finish(sync_id=sid, buckets=1))
                eng.finalize(digest="1f", sync_id=sid)
                assert trainer.recv_type(schema.Ok).body["status"] == "READY"
        load = eng.recv_type(schema.Load)  # the rollback's first (and only) spooled bucket
        assert load.sync_id.startswith("rollback-"), load
        before = c.status(timeout=1.0)["sync"]
        assert before["kind"] == "rollback" and before["buckets"] == 1, before
        msg, frame = bucket_frames(load.sync_id, seq=1, value=9.0)
        for req, payload in ((msg, (frame,)), (schema.Finish(sync_id=load.sync_id, buckets=2), ())):
            err = trainer.request(req, payload)
            assert isinstance(err, schema.Error) and err.code == ErrorCode.INVALID_STATE.value, err
            assert "the daemon's own rollback" in err.message, err.message
        assert c.status(timeout=1.0)["sync"] == before  # nothing of it stood
        eng.send(schema.Loaded(sync_id=load.sync_id, seq=load.seq, source=load.source))
        eng.finalize(digest="1f", sync_id=load.sync_id)
        deadline = time.monotonic() + 30  # a bound on a failure: it ends on the finalize
        while (st := c.status(timeout=1.0))["sync"] is not None and time.monotonic() < deadline:
            eng.heartbeat()
        assert (st["state"], st["version"]) == ("READY", 1), st
        eng.close()
        trainer.close()
