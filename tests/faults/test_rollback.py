"""Rollback to the last good weights and engine rejoin, from the daemon's spool."""

from __future__ import annotations

import signal
import time

import pytest

from examples.tiny import perturbed
from messages.buckets import digest, iter_buckets
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.helpers import FAST_DAEMON, running_daemon


def wait_status(cluster, pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        st = cluster.status()
        if pred(st):
            return st
        time.sleep(0.1)
    raise AssertionError(f"condition not reached within {timeout}s; last status: {st}")


def engine_view(st):
    return {e["engine_id"]: e for e in st["engines"]}


@pytest.fixture
def spooled(tmp_path, tiny_model_dir):
    with running_daemon(
        tmp_path, tiny_model_dir, daemon_args=[*FAST_DAEMON, "--spool", str(tmp_path / "spool")]
    ) as c:
        yield c


def test_aborted_sync_rolls_back_to_the_spooled_version(spooled, tiny_state):
    with spooled.client(timeout=30.0) as client:
        w1 = dict(perturbed(tiny_state, 1))
        r1 = client.push(w1.items(), 1, bucket_bytes=128 * 1024)
        assert client.status()["spool"]["version"] == 1
        sid = client.begin(2).sync_id
        buckets = list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), 128 * 1024))
        for b in buckets[:3]:
            client.send_bucket(sid, b)  # engines now hold a mix of v1 and v2
        client.abort(sid, "trainer gave up")
        st = wait_status(spooled, lambda s: s["state"] == "READY")
        assert (st["version"], st["dirty"], st["digest"]) == (1, False, r1.digest)
        last = st["last_sync"]
        assert last["status"] == "ROLLED_BACK" and last["kind"] == "rollback"
        assert last["rolled_back_from"]["sync_id"] == sid
        assert last["rolled_back_from"]["code"] == "ABORTED"
        for e in st["engines"]:
            assert (e["state"], e["version"], e["digest"]) == ("READY", 1, digest(w1.items()))
            assert e["finalize_count"] == 2  # v1 once, the rollback once: never twice per sync
        # the trainer goes on with the next version
        w3 = dict(perturbed(tiny_state, 3))
        assert client.push(w3.items(), 3).state == "READY"


def test_restarted_engine_rejoins_at_the_served_version(spooled, tiny_state):
    with spooled.client(timeout=30.0) as client:
        r1 = client.push(dict(perturbed(tiny_state, 1)).items(), 1, bucket_bytes=128 * 1024)
        victim = next(p for p in spooled.procs if p.name == "engine-0")
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(10)
        spooled.start_engine("engine-0")  # loads the checkpoint from disk: version 0 weights
        spooled.start_engine("engine-new")  # a new replica
        st = wait_status(
            spooled,
            lambda s: (
                all(e["state"] == "READY" for e in s["engines"] if e["engine_id"] != "engine-0" or e["pid"])
                and len([e for e in s["engines"] if e["state"] == "READY"]) == 3
            ),
        )
        views = engine_view(st)
        for eid in ("engine-0", "engine-1", "engine-new"):
            assert (views[eid]["version"], views[eid]["digest"]) == (1, r1.digest)
        assert views["engine-new"]["finalize_count"] == 1  # its catch-up, once
        assert (st["state"], st["version"]) == ("READY", 1)


def test_engine_registering_mid_sync_joins_at_that_version_after_ready(spooled, tiny_state):
    with spooled.client(timeout=30.0) as client:
        client.push(dict(perturbed(tiny_state, 1)).items(), 1, bucket_bytes=128 * 1024)
        w2 = dict(perturbed(tiny_state, 2))
        sid = client.begin(2).sync_id
        buckets = list(iter_buckets(w2.items(), 128 * 1024))
        client.send_bucket(sid, buckets[0])
        spooled.start_engine("engine-late")
        wait_status(spooled, lambda s: "engine-late" in engine_view(s))
        assert engine_view(spooled.status())["engine-late"]["state"] == "STALE"
        for b in buckets[1:]:
            client.send_bucket(sid, b)
        r2 = client.finish(sid, len(buckets), digest=digest(w2.items()))
        assert sorted(e.engine_id for e in r2.engines) == ["engine-0", "engine-1"]
        st = wait_status(spooled, lambda s: engine_view(s)["engine-late"]["state"] == "READY")
        assert engine_view(st)["engine-late"]["digest"] == digest(w2.items())


def test_next_push_waits_for_a_running_rollback_instead_of_failing(tmp_path, tiny_model_dir, tiny_state):
    args = [*FAST_DAEMON, "--spool", str(tmp_path / "spool")]
    with running_daemon(tmp_path, tiny_model_dir, engines=0, min_engines=2, daemon_args=args) as c:
        for eid in ("engine-0", "engine-1"):  # a 1 s post-load step: the rollback takes a while
            c.start_engine(
                eid, ["--threads", "1", "--heartbeat-interval", "0.5", "--failpoint", "finalize_sleep=1"]
            )
        c.wait_engines(2)
        with c.client(timeout=30.0) as client:
            client.push(dict(perturbed(tiny_state, 1)).items(), 1, bucket_bytes=128 * 1024)
            sid = client.begin(2).sync_id
            client.send_bucket(sid, list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), 128 * 1024))[0])
            client.abort(sid, "trainer gave up")
            wait_status(c, lambda s: s["sync"] is not None and s["sync"]["kind"] == "rollback")
            with pytest.raises(WeightSyncError) as ei:  # without waiting: refused, and why
                client.push(dict(perturbed(tiny_state, 3)).items(), 3, rollback_wait=0)
            assert ei.value.code is ErrorCode.INVALID_STATE and ei.value.details["rollback_running"]
            w3 = dict(perturbed(tiny_state, 3))
            r3 = client.push(w3.items(), 3)  # waits for the rollback, then syncs
            assert r3.state == "READY" and {e["digest"] for e in r3.engines} == {digest(w3.items())}
            assert client.status()["history"][-4]["trigger"] == "finalized"  # the rollback's READY


def test_survivors_are_rolled_back_even_below_min_engines(tmp_path, tiny_model_dir, tiny_state):
    """min_engines gates new syncs, not recovery: with --min-engines 2 and one engine
    killed mid-push, the survivor is rolled back to the served version at once, and the
    dead engine catches up when it returns."""
    args = [*FAST_DAEMON, "--spool", str(tmp_path / "spool")]
    with running_daemon(tmp_path, tiny_model_dir, min_engines=2, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            w1 = dict(perturbed(tiny_state, 1))
            r1 = client.push(w1.items(), 1, bucket_bytes=128 * 1024)
            sid = client.begin(2).sync_id
            buckets = list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), 128 * 1024))
            client.send_bucket(sid, buckets[0])  # the engines now hold a mix of v1 and v2
            victim = next(p for p in c.procs if p.name == "engine-1")
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait(10)
            with pytest.raises(WeightSyncError) as ei:
                for b in buckets[1:]:
                    client.send_bucket(sid, b)
            assert ei.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in ei.value.message
            st = wait_status(c, lambda s: s["state"] == "READY", timeout=15.0)
            assert (st["version"], st["dirty"], st["digest"]) == (1, False, r1.digest)
            view = engine_view(st)
            assert (view["engine-0"]["state"], view["engine-0"]["version"]) == ("READY", 1)
            assert view["engine-1"]["state"] == "LOST"
            assert st["last_sync"]["status"] == "ROLLED_BACK"
            with pytest.raises(WeightSyncError) as ei:  # new syncs still need two engines
                client.begin(3)
            assert ei.value.code is ErrorCode.NO_ENGINES
            c.start_engine("engine-1")
            st = wait_status(
                c,
                lambda s: (
                    all(e["state"] == "READY" and e["version"] == 1 for e in s["engines"])
                    and len(s["engines"]) == 2
                ),
            )
            assert {e["digest"] for e in st["engines"]} == {digest(w1.items())}
