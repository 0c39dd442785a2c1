"""Reliability round three through real daemons and torch engines: an engine that closes
its connection is out at once, a lost engine is logged with its cause, counts say
registered vs live, a failed push reports the state its rollback settles in."""

from __future__ import annotations

import json
import signal
import time

import pytest

from examples.tiny import perturbed
from messages.errors import WeightSyncError

from .helpers import running_daemon, wait_for

pytestmark = pytest.mark.slow


def _log_events(path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_an_engine_stopped_cleanly_is_out_at_once_and_the_next_push_does_notwait_for(
    tmp_path, tiny_model_dir, tiny_state
):
    """SIGTERM one of two engines, push as soon as it exited: READY on the survivor in
    seconds (not after --engine-timeout), and the daemon logs the engine lost with its
    cause."""
    args = ["--engine-timeout", "30", "--log-level", "info"]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=1, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            assert client.push(perturbed(tiny_state, 1), 1).state == "READY"
            stopped = next(p for p in c.procs if p.name == "engine-1")
            stopped.popen.send_signal(signal.SIGTERM)
            assert stopped.popen.wait(timeout=30) == 0
            t0 = time.monotonic()
            r = client.push(perturbed(tiny_state, 2), 2)
            took = time.monotonic() - t0
        assert r.state == "READY" and took < 5.0, (r, took)
        engines = {e["engine_id"]: e for e in c.status()["engines"]}
        assert engines["engine-0"]["state"] == "READY" and engines["engine-0"]["version"] == 2
        assert engines["engine-1"]["state"] == "LOST"
        lost = [e for e in _log_events(c.daemon.log_path) if e.get("event") == "engine_lost"]
        # it stopped cleanly: it said goodbye, and was out at once (no --engine-grace)
        assert [(e["engine_id"], e["cause"]) for e in lost] == [("engine-1", "it stopped (it said goodbye)")]


def test_an_engine_stopped_mid_sync_fails_it_at_once_naming_the_closed_connection(
    tmp_path, tiny_model_dir, tiny_state
):
    """An inline participant whose process exits mid-push fails the sync at once with
    ENGINE_FAILED naming its closed connection, not at --bucket-timeout (here 60 s)."""
    args = ["--engine-timeout", "30", "--bucket-timeout", "60", "--log-level", "info"]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=1, daemon_args=args) as c:
        victim = next(p for p in c.procs if p.name == "engine-1")

        def stopping():
            for i, item in enumerate(perturbed(tiny_state, 1)):
                if i == 4:
                    victim.popen.send_signal(signal.SIGKILL)
                    victim.popen.wait(timeout=30)
                yield item

        t0 = time.monotonic()
        with c.client(timeout=60.0) as client, pytest.raises(WeightSyncError) as ei:
            client.push(stopping(), 1, bucket_bytes=64 * 1024, transport="inline", window=1)
        assert time.monotonic() - t0 < 20.0
        assert ei.value.code.value == "ENGINE_FAILED"
        assert "engine-1: its connection closed" in ei.value.message


def test_an_engine_lost_by_heartbeat_is_logged_with_its_cause(tmp_path, tiny_model_dir, tiny_state):
    args = ["--engine-timeout", "2", "--log-level", "info"]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=1, daemon_args=args) as c:
        frozen = next(p for p in c.procs if p.name == "engine-1")
        frozen.popen.send_signal(signal.SIGSTOP)
        try:
            wait_for(
                lambda: any(
                    e.get("event") == "engine_lost" and e.get("engine_id") == "engine-1"
                    for e in _log_events(c.daemon.log_path)
                ),
                30,
                "engine_lost logged",
            )
        finally:
            frozen.popen.send_signal(signal.SIGCONT)
        lost = [e for e in _log_events(c.daemon.log_path) if e.get("event") == "engine_lost"]
        assert (
            lost[0]["cause"].startswith("no heartbeat for ") and "--engine-timeout 2.0s" in lost[0]["cause"]
        )


def test_a_failed_push_reports_the_state_its_rollback_settles_in(tmp_path, tiny_model_dir, tiny_state):
    """A push that fails after its buckets reached the engines (a checkpoint missing a
    tensor: INCOMPLETE_SYNC) is rolled back from the spool; `weightsync push` says the
    daemon is READY at the version it served, not the IDLE/None of the moment it failed."""
    from safetensors.torch import save_file

    from .helpers import ws

    args = ["--engine-timeout", "5", "--spool", str(tmp_path / "spool"), "--log-level", "info"]
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=2, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            assert client.push(perturbed(tiny_state, 1), 1).state == "READY"
        part = tmp_path / "part"
        part.mkdir()
        items = dict(perturbed(tiny_state, 2))
        items.pop(sorted(items)[0])
        save_file(items, str(part / "model.safetensors"))
        r = ws("push", str(part), "--version", "2", "--addr", c.addr, "--json")
        assert r.returncode == 4, r.stderr
        out = json.loads(r.stdout)
        assert out["code"] == "INCOMPLETE_SYNC", out
        assert (out["state"], out["daemon_version"], out["details"]["settled"]) == ("READY", 1, True), out
        assert out["version"] == 2, out  # the version pushed
        assert "(daemon state READY, version 1)" in r.stderr, r.stderr
        st = c.status()
        assert st["state"] == "READY" and {e["version"] for e in st["engines"]} == {1}
