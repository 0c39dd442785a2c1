"""`weightsync status` says what the fleet serves, not only what the daemon committed
(issue 44, item 6), and `status --watch` outlives its daemon (items 4 and 7):

- a daemon restarted without a spool, its engines restarted too: READY at the committed
  version, but no engine serves it (`served_by: 0`, and a plain line saying so);
- a sharded push's sources in the plain table (a source that never began is named);
- `status --watch` reports an outage and resumes across a daemon restart, and SIGTERM
  ends it with 130, as Ctrl-C does.

The vLLM server whose process died between syncs: tests/vllm/test_server_health.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from queue import Empty, Queue
from typing import Any

from examples.tiny import perturbed
from messages.buckets import iter_buckets

from .helpers import running_daemon, sigint_default, wait_for, ws


def test_status_says_when_no_engine_serves_the_served_version(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=1) as cluster:
        with cluster.client(timeout=60) as c:
            c.push(perturbed(tiny_state, 402), 402)
        st = cluster.status()
        assert st["state"] == "READY" and st["version"] == 402 and st["served_by"] == 1, st
        # the daemon restarts (state DB, no spool) and so does its engine: it comes back
        # with the weights it loads at start, not version 402, and nothing can bring it there
        engine = cluster.procs[-1]
        assert engine.stop() == 0 and cluster.daemon.stop() == 0
        cluster.start_daemon()
        cluster.start_engine(engine.name)
        st = cluster.wait_engines(1)
        assert st["state"] == "READY" and st["version"] == 402, st
        assert [e["state"] for e in st["engines"]] == ["STALE"], st
        assert st["served_by"] == 0, st

        r = ws("status", "--addr", cluster.addr, "--json", timeout=30)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["served_by"] == 0
        r = ws("status", "--addr", cluster.addr, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "version 402 is not served by any engine" in r.stdout, r.stdout
        assert "served by 0 of 1 live engines" in r.stdout, r.stdout


def test_plain_status_shows_a_sharded_pushs_sources(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=1) as cluster:
        weights = dict(perturbed(tiny_state, 7))
        buckets = list(iter_buckets(weights.items(), 64 * 1024))
        with cluster.client(timeout=60) as c:
            sid = c.begin(7, sources=2, source=0).sync_id
            c.send_bucket(sid, buckets[0])
            r = ws("status", "--addr", cluster.addr, timeout=30)
            c.abort(sid, "test over")
        assert r.returncode == 0, r.stderr
        rows = {ln.split("│")[1].strip(): ln for ln in r.stdout.splitlines() if ln.count("│") >= 7}
        assert f"sources of sync {sid[:8]} (2)" in r.stdout, r.stdout
        assert "never began" in rows["1"] and "never began" not in rows["0"], r.stdout


def _watch(addr: str) -> tuple[subprocess.Popen[str], Queue[dict[str, Any]]]:
    """`weightsync status --watch 0.2 --json` and a queue of the objects it prints."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "status",
            "--addr",
            addr,
            "--watch",
            "0.2",
            "--json",
            "--timeout",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=sigint_default,  # the test sends it SIGINT: never inherited as ignored
    )
    q: Queue[dict[str, Any]] = Queue()

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            q.put(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return p, q


def _next(q: Queue[dict[str, Any]], pred: Any, timeout: float, what: str) -> dict[str, Any]:
    """The first object the watcher prints that `pred` accepts (others are skipped)."""
    seen: list[dict[str, Any]] = []

    def got() -> dict[str, Any] | None:
        try:
            obj = q.get(timeout=0.1)
        except Empty:
            return None
        seen.append(obj)
        return obj if pred(obj) else None

    return wait_for(got, timeout, what, every=0)


def test_status_watch_outlives_a_daemon_restart_and_exits_130_on_sigterm(tmp_path, tiny_model_dir):
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=1) as cluster:
        # SIGTERM ends a watch as Ctrl-C does: 130 (the README's exit code for both)
        p, q = _watch(cluster.addr)
        try:
            _next(q, lambda o: o.get("state") == "IDLE", 30, "a first status")
            p.send_signal(signal.SIGTERM)
            assert p.wait(15) == 130, p.stderr.read() if p.stderr else ""
        finally:
            if p.poll() is None:
                p.kill()

        p, q = _watch(cluster.addr)
        try:
            _next(q, lambda o: "state" in o, 30, "a first status")
            cluster.daemon.popen.send_signal(signal.SIGKILL)
            cluster.daemon.popen.wait(10)
            down = _next(q, lambda o: o.get("waiting") == "daemon", 30, "the outage said")
            assert down["ok"] is False and down["code"] in ("UNREACHABLE", "TIMEOUT"), down
            assert p.poll() is None, "the watch ended with its daemon"
            cluster.start_daemon()
            # the same watch answers again from the restarted daemon (it was never stopped)
            _next(q, lambda o: "state" in o, 30, "a status from the restarted daemon")
            assert p.poll() is None
            p.send_signal(signal.SIGINT)
            assert p.wait(15) == 130
        finally:
            if p.poll() is None:
                p.kill()
