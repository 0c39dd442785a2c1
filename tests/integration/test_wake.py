"""The daemon sleeps until the core's next deadline or an input, with no fixed tick: a
real daemon subprocess, an engine over a real ZeroMQ socket that registers and then goes
silent, the daemon's own log (its `timer_tick` debug line, its timestamps) and the
kernel's count of the times the daemon's loop thread went to sleep."""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from examples.launch import Cluster
from messages import schema
from tests.faults.scripted import Peer, ScriptedEngine, bucket_frames
from tests.integration.helpers import wait_for

ENGINE_TIMEOUT = 1.5
# seconds past --engine-timeout the daemon may take to say an engine is lost: a loaded CI
# machine may run its loop late; a fixed tick is told apart by the tick and sleep counts
MARGIN = 1.0


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _one(events: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    found = [e for e in events if e.get("event") == name]
    return found[0] if len(found) == 1 else None


def _sleeps(pid: int) -> int:
    """How many times the process's main thread (the daemon's event loop) blocked."""
    text = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", text, re.M)
    assert m is not None, text
    return int(m.group(1))


def _at(e: dict[str, Any]) -> float:
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def test_a_silent_engine_is_lost_at_its_deadline_and_the_daemon_sleeps_until_then(tmp_path):
    """With one engine registered and silent, the daemon's only deadline is that engine's
    --engine-timeout: it ticks once, at it (lost within MARGIN of it, by its own log's
    clock), and its loop thread sleeps through the wait instead of waking every 0.2 s
    (a fixed tick: ~7 ticks and, with the quiet fleet's 50 ms reads, ~30 wake-ups)."""
    args = ["--engine-timeout", str(ENGINE_TIMEOUT), "--log-level", "debug"]
    c = Cluster(tmp_path / "d", None, engines=0, min_engines=1, daemon_args=args)
    with c:
        log, pid = c.daemon.log_path, c.daemon.popen.pid
        eng = ScriptedEngine(c.engine_addr, "silent")  # registered once this returns
        try:
            before = _sleeps(pid)
            ticks_before = len([e for e in _events(log) if e.get("event") == "timer_tick"])
            lost = wait_for(
                lambda: _one(_events(log), "engine_lost"), ENGINE_TIMEOUT + 10, "the silent engine lost"
            )
            sleeps = _sleeps(pid) - before
            events = _events(log)
            registered = _one(events, "engine_registered")
            assert registered is not None and lost["engine_id"] == "silent", events
            late = _at(lost) - _at(registered)
            ticks = len([e for e in events if e.get("event") == "timer_tick"]) - ticks_before
            assert ENGINE_TIMEOUT <= late <= ENGINE_TIMEOUT + MARGIN, (late, lost)
            assert 1 <= ticks <= 2, ticks
            assert sleeps <= 10, sleeps
            print(f"lost {late - ENGINE_TIMEOUT:.4f}s past the deadline; ticks {ticks}; loop sleeps {sleeps}")
        finally:
            eng.close()


def test_an_idle_daemon_with_no_deadline_does_not_wake(tmp_path):
    """No engine, no sync: `next_wake` is None and the loop waits for an input only. The
    window ends on a condition (the trainer-side client's own clock passed a second and a
    half, the daemon untouched meanwhile); across it the loop thread never woke."""
    c = Cluster(tmp_path / "d", None, engines=0, min_engines=1, daemon_args=["--log-level", "debug"])
    with c:
        pid = c.daemon.popen.pid
        # up and serving, asked on a connection that stays open across the window (a
        # connection's close is an input of its own, which the loop takes when it comes)
        peer = Peer(c.addr)
        try:
            assert isinstance(peer.request(schema.Status()), schema.Ok)
            before, start = _sleeps(pid), time.monotonic()
            wait_for(lambda: time.monotonic() - start >= 1.5, 10, "a second and a half", every=0.05)
            woke = _sleeps(pid) - before
        finally:
            peer.close()
        ticks = [e for e in _events(c.daemon.log_path) if e.get("event") == "timer_tick"]
        assert woke <= 1 and not ticks, (woke, ticks)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used, from the kernel's count."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_after_a_sync_the_idle_daemon_sleeps_instead_of_spinning(tmp_path):
    """A sync's journal writes end in a task that nudges the loop (a byte on a socket
    pair). The loop once looked for that socket among the poll's events by object while
    the poller reports a plain socket by its descriptor: the byte was never read, every
    poll returned at once, and the idle daemon spun on a core. After a sync to READY, the
    daemon uses (nearly) no CPU across a second and a half of idleness."""
    c = Cluster(tmp_path / "d", None, engines=0, min_engines=1, daemon_args=["--log-level", "error"])
    with c:
        pid = c.daemon.popen.pid
        eng, trainer = ScriptedEngine(c.engine_addr), Peer(c.addr)
        try:
            assert isinstance(trainer.request(schema.Begin(sync_id="w1", version=1)), schema.Ok)
            msg, frame = bucket_frames("w1")
            trainer.send(msg, (frame,))
            eng.ack_load(sync_id="w1")
            assert isinstance(trainer.recv_type(schema.Ok), schema.Ok)
            trainer.send(schema.Finish(sync_id="w1", buckets=1))
            eng.finalize(digest="1f", sync_id="w1")
            assert trainer.recv_type(schema.Ok).body["status"] == "READY"
            c.status()  # every batch of the sync has run (the status comes after them)
            before, start = _cpu_seconds(pid), time.monotonic()
            wait_for(lambda: time.monotonic() - start >= 1.5, 10, "a second and a half", every=0.05)
            used = _cpu_seconds(pid) - before
            assert used < 0.3, f"the idle daemon used {used:.2f} s of CPU in 1.5 s"
        finally:
            eng.close()
            trainer.close()


def test_sigterm_wakes_a_daemon_that_waits_for_no_deadline(tmp_path):
    """With no deadline running (its one engine registered and then left), the loop waits
    for an input only; SIGTERM must wake it. Once the signal set the stop flag and left
    the loop asleep: the stop ran out its grace and the daemon was SIGKILLed (-9). Here it
    exits 0 well inside the grace, and says so in its log."""
    c = Cluster(tmp_path / "d", None, engines=0, min_engines=1, daemon_args=["--log-level", "info"])
    with c:
        daemon = c.daemon
        eng = ScriptedEngine(c.engine_addr, "leaving")  # registered once this returns
        eng.close()  # its connection closes: lost at once, no deadline runs after it
        wait_for(lambda: _one(_events(daemon.log_path), "engine_lost"), 30, "the engine lost")
        # the only deadline left is --lost-expiry's, an hour away
        assert daemon.stop(grace=20.0) == 0, daemon.log_path.read_text()[-2000:]
        assert _one(_events(daemon.log_path), "daemon_stopped") is not None
