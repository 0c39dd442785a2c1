"""What the daemon keeps per sync does not grow with refused requests: a live daemon, raw
sockets, the count of syncs its bookkeeping holds anything of (status `queues.tracked_syncs`)."""

from __future__ import annotations

import pytest

from examples.launch import Cluster
from messages import schema
from tests.integration.helpers import wait_for

from .scripted import Peer, ScriptedEngine, bucket_frames


def tracked(c: Cluster) -> int:
    return int(c.status()["queues"]["tracked_syncs"])


@pytest.mark.parametrize("engine", [False, True], ids=["no-engine", "sync-running"])
def test_refused_begins_buckets_and_finishes_leave_nothing_behind(tmp_path, engine):
    """Begins refused (with a bucket size), buckets and finishes for syncs that are not
    running: the daemon holds the running sync's entries only, before and after."""
    c = Cluster(tmp_path / "d", None, engines=0, min_engines=1, daemon_args=["--engine-timeout", "30"])
    with c:
        trainer = Peer(c.addr)
        eng = ScriptedEngine(c.engine_addr) if engine else None
        try:
            running = 0
            if eng is not None:
                ok = trainer.request(schema.Begin(sync_id="good-1", version=1, bucket_bytes=1 << 20))
                assert isinstance(ok, schema.Ok), ok
                running = wait_for(lambda: tracked(c) == 1 and 1, 10, "the running sync tracked")
            for i in range(20):  # refused: no engine, or a sync already running
                reply = trainer.request(schema.Begin(sync_id=f"refused-{i}", version=2, bucket_bytes=1 << 20))
                assert isinstance(reply, schema.Error), reply
                msg, frame = bucket_frames(f"nobody-{i}")
                assert isinstance(trainer.request(msg, (frame,)), schema.Error)
                assert isinstance(
                    trainer.request(schema.Finish(sync_id=f"nobody-{i}", buckets=1)), schema.Error
                )
            assert tracked(c) == running
            if eng is not None:
                assert isinstance(trainer.request(schema.Abort(sync_id="good-1", reason="test")), schema.Ok)
                wait_for(lambda: tracked(c) == 0, 10, "the aborted sync forgotten")
        finally:
            trainer.close()
            if eng is not None:
                eng.close()


def test_a_lost_engine_is_forgotten_after_lost_expiry(tmp_path):
    """An engine whose connection closed is LOST, then gone from status once --lost-expiry
    passed; the one still heartbeating stays."""
    args = ["--engine-timeout", "30", "--lost-expiry", "1"]
    c = Cluster(tmp_path / "d", None, engines=0, min_engines=1, daemon_args=args)
    with c:
        stays, goes = ScriptedEngine(c.engine_addr, "stays"), ScriptedEngine(c.engine_addr, "goes")
        try:

            def states() -> dict[str, str]:
                stays.heartbeat()
                return {x["engine_id"]: x["state"] for x in c.status()["engines"]}

            assert states() == {"stays": "STALE", "goes": "STALE"}
            goes.close()
            wait_for(lambda: states().get("goes") == "LOST", 10, "the closed engine LOST")
            wait_for(lambda: states() == {"stays": "STALE"}, 10, "the LOST engine forgotten")
        finally:
            stays.close()
            goes.close()
