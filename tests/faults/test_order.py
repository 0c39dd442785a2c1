"""Persist, then tell engines, then reply: a daemon SIGKILLed between two of those steps
restarts consistent, and no trainer ever holds an `ok` for a state its journal lacks."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.helpers import FAST_DAEMON, running_daemon

pytestmark = pytest.mark.slow
BUCKET = 256 * 1024


def journal(c) -> list[tuple[str, str, str | None]]:
    db = sqlite3.connect(c.state_db)
    try:
        return db.execute("SELECT src, dst, sync_id FROM transitions ORDER BY id").fetchall()
    finally:
        db.close()


def restart_plain(c):
    """Start the daemon again without the failpoint; wait for the engine to come back."""
    c.daemon.popen.wait(15)
    assert c.daemon.popen.returncode == -9  # it was the failpoint, not a crash
    c.daemon_args = list(FAST_DAEMON)
    c.start_daemon()
    return c.wait_engines(1, timeout=60)


def test_killed_after_begin_is_journaled_but_before_the_ok(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(
        tmp_path,
        tiny_model_dir,
        engines=1,
        daemon_args=[*FAST_DAEMON, "--failpoint", "kill_after_persisted=begin"],
    ) as c:
        with c.client(timeout=5.0, retries=0) as client:
            with pytest.raises(WeightSyncError) as ei:
                client.begin(1, sync_id="killed-begin")
            assert ei.value.code in (ErrorCode.TIMEOUT, ErrorCode.UNREACHABLE)  # never an ok
        assert ("IDLE", "LOADING_BUCKETS", "killed-begin") in journal(c)
        st = restart_plain(c)
        assert (st["state"], st["sync"]) == ("IDLE", None)  # the interrupted sync is over
        with c.client(timeout=30.0) as client:
            w = dict(perturbed(tiny_state, 1))
            r = client.push(w.items(), 1, bucket_bytes=BUCKET)
            assert r.state == "READY" and r.engines[0]["digest"] == digest(w.items())


def test_killed_after_engines_were_told_to_finalize_never_claims_ready(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(
        tmp_path,
        tiny_model_dir,
        engines=1,
        daemon_args=[*FAST_DAEMON, "--failpoint", "kill_after_told=finish"],
    ) as c:
        with c.client(timeout=5.0, retries=0) as client:
            w = dict(perturbed(tiny_state, 1))
            with pytest.raises(WeightSyncError):
                client.push(w.items(), 1, bucket_bytes=BUCKET)
        rows = journal(c)
        assert rows[-1][:2] == ("LOADING_BUCKETS", "FINALIZING")  # persisted, then told
        st = restart_plain(c)
        assert st["state"] == "IDLE" and st["dirty"] is True and st["version"] is None
        with c.client(timeout=30.0) as client:
            w = dict(perturbed(tiny_state, 2))
            r = client.push(w.items(), 2, bucket_bytes=BUCKET)
        assert r.state == "READY"
        # The kill may land before ZeroMQ flushed the finalize to the engine ("told" is
        # handed to the socket, not yet delivered): the engine ran v1's post-load step or
        # not, but never any step twice.
        finalized = [
            json.loads(line)["sync_id"]
            for line in (c.log_dir / "engine-0.log").read_text().splitlines()
            if '"engine_finalized"' in line
        ]
        assert len(finalized) == len(set(finalized)) == r.engines[0]["finalize_count"] in (1, 2)


def test_killed_after_ready_is_journaled_serves_it_after_restart(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(
        tmp_path,
        tiny_model_dir,
        engines=1,
        daemon_args=[*FAST_DAEMON, "--failpoint", "kill_after_persisted=finalized"],
    ) as c:
        w = dict(perturbed(tiny_state, 1))
        with c.client(timeout=5.0, retries=0) as client:
            with pytest.raises(WeightSyncError):
                client.push(w.items(), 1, bucket_bytes=BUCKET, sync_id="ready-unanswered")
        assert journal(c)[-1] == ("FINALIZING", "READY", "ready-unanswered")
        restart_plain(c)
        deadline = time.monotonic() + 30
        while (st := c.status())["engines"][0]["state"] != "READY" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (st["state"], st["version"], st["engines"][0]["digest"]) == ("READY", 1, digest(w.items()))
        with c.client(timeout=10.0) as client:  # the trainer's retry hears what happened
            with pytest.raises(WeightSyncError) as ei:
                client.finish("ready-unanswered", 1)
        assert ei.value.code is ErrorCode.INVALID_STATE and "already completed (READY)" in ei.value.message


def test_a_daemon_stopped_during_an_untouched_sync_stays_ready_across_its_restart(
    tmp_path, tiny_model_dir, tiny_state
):
    """SIGTERM while a sync is begun but nothing reached an engine: the daemon stops
    cleanly (it raised INTERNAL here: the table had no shutdown row to READY), journals the
    sync ended clean, and comes back READY at the served version with no rollback."""
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c:
        w = dict(perturbed(tiny_state, 1))
        with c.client(timeout=10.0) as client:
            assert client.push(w.items(), 1, bucket_bytes=BUCKET).state == "READY"
            client.begin(2, "begun-then-stopped")
        assert c.daemon.stop(grace=30) == 0, c.daemon.log_tail()
        assert journal(c)[-1] == ("LOADING_BUCKETS", "READY", "begun-then-stopped")
        c.start_daemon()
        st = c.wait_engines(1, timeout=60)
        assert (st["state"], st["version"], st["dirty"]) == ("READY", 1, False)
        assert not [h for h in st["history"] if h["trigger"] == "tick"]  # no rollback ran
        with c.client(timeout=10.0) as client:
            assert (
                client.push(dict(perturbed(tiny_state, 2)).items(), 2, bucket_bytes=BUCKET).state == "READY"
            )
