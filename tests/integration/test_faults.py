"""Deadlines, lost engines, crashes and restarts: never a silent READY, never a wedge."""

from __future__ import annotations

import json
import signal
import time

import pytest

from examples.tiny import perturbed
from messages.buckets import digest, iter_buckets
from messages.errors import EngineError, ErrorCode

from .helpers import running_daemon


def test_engine_killed_mid_sync_fails_with_engine_failed_and_dirty(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir) as cluster, cluster.client(timeout=30.0) as client:
        client.push(dict(perturbed(tiny_state, 1)).items(), 1)
        buckets = list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), 128 * 1024))
        sid = client.begin(2).sync_id
        client.send_bucket(sid, buckets[0])
        victim = next(p for p in cluster.procs if p.name == "engine-1")
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(10)
        t0 = time.monotonic()
        with pytest.raises(EngineError) as ei:
            client.send_bucket(sid, buckets[1])
        assert ei.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in ei.value.message
        assert time.monotonic() - t0 < 15  # the engine deadline (3s) + a tick, not a wedge
        st = client.status()
        assert (st["state"], st["dirty"], st["version"]) == ("IDLE", True, None)
        lost = {e["engine_id"]: e["state"] for e in st["engines"]}
        assert lost["engine-1"] == "LOST"
        # with one engine left (min_engines=2) a new sync is refused, clearly
        with pytest.raises(EngineError) as ei:
            client.begin(3)
        assert ei.value.code is ErrorCode.NO_ENGINES
        # a replacement engine registers and the next version goes through
        cluster.start_engine("engine-1")
        cluster.wait_engines(2)
        w = dict(perturbed(tiny_state, 3))
        r = client.push(w.items(), 3)
        assert r.state == "READY" and {e["digest"] for e in r.engines} == {digest(w.items())}
        assert client.status()["dirty"] is False


def test_trainer_vanishing_mid_sync_times_out(tmp_path, tiny_model_dir, tiny_state):
    args = ["--engine-timeout", "3", "--sync-timeout", "1.5"]
    with running_daemon(tmp_path, tiny_model_dir, daemon_args=args) as cluster:
        with cluster.client() as gone:
            sid = gone.begin(1).sync_id
            (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, 1)).items(), 128 * 1024))
            gone.send_bucket(sid, b)
        # that trainer is gone; the daemon must not wait forever
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            st = cluster.status()
            if st["state"] == "IDLE":
                break
            time.sleep(0.2)
        assert st["state"] == "IDLE" and st["dirty"] is True
        assert st["last_sync"]["code"] == "TIMEOUT"
        with cluster.client() as c:
            assert c.push(dict(perturbed(tiny_state, 2)).items(), 2).state == "READY"


def test_daemon_crash_mid_sync_recovers_idle_dirty_and_last_ready(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir) as cluster:
        with cluster.client() as client:
            client.push(dict(perturbed(tiny_state, 1)).items(), 1)
            sid = client.begin(2).sync_id
            (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), 128 * 1024))
            client.send_bucket(sid, b)
        cluster.daemon.popen.send_signal(signal.SIGKILL)  # a crash, not a shutdown
        cluster.daemon.popen.wait(10)
        cluster.start_daemon()
        st = cluster.wait_engines(2)
        assert (st["state"], st["dirty"], st["version"]) == ("IDLE", True, None)
        assert st["last_ready_version"] == 1
        assert st["history"][-1]["to"] == "LOADING_BUCKETS"  # the interrupted sync, from the journal
        # version 2 was never served, so it may be pushed again
        with cluster.client() as client:
            w = dict(perturbed(tiny_state, 2))
            assert client.push(w.items(), 2).digest == digest(w.items())


def test_restart_after_ready_keeps_serving_version(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir) as cluster:
        with cluster.client() as client:
            client.push(dict(perturbed(tiny_state, 5)).items(), 5)
        cluster.daemon.popen.send_signal(signal.SIGTERM)
        assert cluster.daemon.popen.wait(15) == 0  # graceful exit
        cluster.start_daemon()
        st = cluster.wait_engines(2)
        assert (st["state"], st["version"], st["dirty"]) == ("READY", 5, False)
        # engines re-registered holding the served digest: they are READY, not stale
        assert [e["state"] for e in st["engines"]] == ["READY", "READY"]
        with cluster.client() as client, pytest.raises(Exception) as ei:
            client.begin(5)
        assert getattr(ei.value, "code", None) is ErrorCode.STALE_VERSION


def test_sigterm_during_sync_fails_the_waiting_trainer_not_silently(tmp_path, tiny_model_dir, tiny_state):
    with (
        running_daemon(tmp_path, tiny_model_dir) as cluster,
        cluster.client(timeout=5.0, retries=0) as client,
    ):
        sid = client.begin(1).sync_id
        assert client.status()["state"] == "LOADING_BUCKETS"
        cluster.daemon.popen.send_signal(signal.SIGTERM)
        assert cluster.daemon.popen.wait(15) == 0
        log = cluster.daemon.log_path.read_text()
        assert "daemon_stopped" in log and "sync_failed" in log
        events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        failed = [e for e in events if e["event"] == "sync_failed"]
        assert failed[-1]["sync_id"] == sid and failed[-1]["code"] == "INTERNAL"
        # the journal says the sync did not complete: a restart comes back IDLE, not READY
        cluster.start_daemon()
        st = cluster.wait_engines(2)
        assert st["state"] == "IDLE" and st["history"][-1]["code"] == "INTERNAL"
