"""A daemon started on a state database and spool whose served digest was made by another
digest scheme (v5's xxh3-128 over the sorted parts; v6 sums them): one clear
DIGEST_SCHEME_MISMATCH line, no rollback or catch-up against a digest no engine can
reproduce, every engine kept; the next push records this daemon's scheme."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import xxhash

from examples.tiny import perturbed
from messages import delta
from messages.buckets import digest, iter_buckets
from messages.errors import WeightSyncError

from .helpers import finalized_syncs, running_daemon, wait_for, ws

pytestmark = pytest.mark.slow

# The names on disk, spelled out: the files are what an older daemon left behind.
V5_SCHEME = "sorted128"
V6_SCHEME = "sum128"


# What a daemon does to engines against a digest they cannot reproduce.
BAD = ("rollback_started", "engine_catchup_started", "engine_catchup_failed", "engine_lost")


def _v5_digest(weights: dict[str, Any]) -> str:
    """The weight digest as a v5 daemon recorded it: xxh3-128 over the name-sorted parts."""
    h = xxhash.xxh3_128()
    for name in sorted(weights):
        h.update(name.encode() + b"\0")
        h.update(delta.part(name, weights[name]))
    return h.hexdigest()


def _as_v5(state_db: Path, spool: Path, v5_digest: str, *, scheme: str | None) -> None:
    """Rewrite the stopped daemon's journal and spool as an older daemon left them: the
    served digest is `v5_digest`; with `scheme` None the files record no scheme at all
    (v5's layout: no column, no manifest key), else they record `scheme`."""
    db = sqlite3.connect(state_db)
    try:
        cols = {r[1] for r in db.execute("PRAGMA table_info(syncs)")}
        db.execute("UPDATE syncs SET digest=? WHERE status='READY'", (v5_digest,))
        if "digest_scheme" in cols:
            if scheme is None:
                db.execute("ALTER TABLE syncs DROP COLUMN digest_scheme")
            else:
                db.execute("UPDATE syncs SET digest_scheme=? WHERE status='READY'", (scheme,))
        db.commit()
    finally:
        db.close()
    manifest = spool / "current" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["digest"] = v5_digest
    raw.pop("digest_scheme", None)
    if scheme is not None:
        raw["digest_scheme"] = scheme
    manifest.write_text(json.dumps(raw))


def _events(path: Path, since: int) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes()[since:].decode(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and "event" in e:
            out.append(e)
    return out


def _status(c: Any) -> dict[str, Any] | None:
    """The daemon's status, or None while the restarted daemon does not answer yet."""
    try:
        st: dict[str, Any] = c.status()
    except WeightSyncError:
        return None
    return st


def _settled(c: Any, n: int) -> dict[str, Any] | None:
    """Status once `n` engines are registered, none LOST or JOINING, no sync running and no
    rollback pending: whatever the daemon does with its spool has been done by then."""
    st = _status(c)
    if st is None:
        return None
    engines = st["engines"]
    if (
        len(engines) == n
        and all(e["state"] in ("STALE", "READY") for e in engines)
        and st["sync"] is None
        and not st["rollback_pending"]
    ):
        return st
    return None


def _mismatch_logged(log: list[dict[str, Any]]) -> dict[str, Any]:
    (line,) = [e for e in log if e.get("event") == "digest_scheme_mismatch"]
    assert line["code"] == "DIGEST_SCHEME_MISMATCH" and line["level"] == "error", line
    assert "Push a new version" in line["reason"], line
    return line


def test_a_v5_state_db_and_spool_after_a_crash_is_one_clear_error_and_no_engine_is_lost(
    tmp_path, tiny_model_dir, tiny_state
):
    """v1 served, a crash mid-push of v2 (dirty), files rewritten as v5 left them (no scheme
    recorded anywhere). Today's daemon rolled back against the v5 digest, failed each
    engine in turn (ENGINE_FAILED: digest) and lost them all; now it says
    DIGEST_SCHEME_MISMATCH once, runs no rollback, keeps both engines, and v2 goes through."""
    spool = tmp_path / "spool"
    args = ["--engine-timeout", "5", "--spool", str(spool), "--log-level", "info"]
    w1 = dict(perturbed(tiny_state, 1))
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=2, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            assert client.push(w1.items(), 1).digest == digest(w1.items())
            sid = client.begin(2).sync_id
            (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), 128 * 1024))
            client.send_bucket(sid, b)  # the engines hold part of v2 now
        c.daemon.popen.send_signal(signal.SIGKILL)
        c.daemon.popen.wait(10)
        v5 = _v5_digest(w1)
        assert v5 != digest(w1.items())
        _as_v5(c.state_db, spool, v5, scheme=None)
        since = c.daemon.log_path.stat().st_size
        c.start_daemon()
        st = wait_for(lambda: _settled(c, 2), 60, "both engines registered, nothing running")
        log = _events(c.daemon.log_path, since)
        damage = [(e["event"], e.get("engine_id"), e.get("cause")) for e in log if e["event"] in BAD]
        assert damage == [], damage
        line = _mismatch_logged(log)
        assert line["recorded"] == {"served": V5_SCHEME, "spool": V5_SCHEME}, line
        assert (st["state"], st["dirty"], st["last_ready_version"]) == ("IDLE", True, 1), st
        assert st["digest_scheme_error"]["code"] == "DIGEST_SCHEME_MISMATCH", st
        assert st["last_sync"] is None  # no rollback was tried
        for p in c.procs[1:]:
            assert not [s for s in finalized_syncs(p) if s.startswith("rollback-")], p.name
        # the operator's step: push a new version; it records this daemon's scheme
        w2 = dict(perturbed(tiny_state, 2))
        with c.client(timeout=30.0) as client:
            r = client.push(w2.items(), 2)
        assert r.state == "READY" and {e["digest"] for e in r.engines} == {digest(w2.items())}
        st = c.status()
        assert (st["digest_scheme"], st["digest_scheme_error"]) == (V6_SCHEME, None), st
        assert st["spool"]["digest_scheme"] == V6_SCHEME, st["spool"]


def test_a_recorded_old_scheme_at_a_clean_restart_keeps_the_engines_and_a_push_records_the_new(
    tmp_path, tiny_model_dir, tiny_state
):
    """v1 served, a graceful stop, the journal's and the spool's scheme field (and digest)
    set to v5's. Today's daemon sent each engine the whole spool as a catch-up and then
    judged it wrong (version cleared); now no catch-up runs, each engine keeps the version
    it reports (STALE: unverified), and after a push a second restart is READY at once:
    the scheme the push recorded is this daemon's."""
    spool = tmp_path / "spool"
    args = ["--engine-timeout", "5", "--spool", str(spool), "--log-level", "info"]
    w1 = dict(perturbed(tiny_state, 1))
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=2, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            client.push(w1.items(), 1)
        c.daemon.popen.send_signal(signal.SIGTERM)
        assert c.daemon.popen.wait(15) == 0
        _as_v5(c.state_db, spool, _v5_digest(w1), scheme=V5_SCHEME)
        since = c.daemon.log_path.stat().st_size
        c.start_daemon()
        st = wait_for(lambda: _settled(c, 2), 60, "both engines registered, no catch-up running")
        log = _events(c.daemon.log_path, since)
        damage = [(e["event"], e.get("engine_id"), e.get("reason")) for e in log if e["event"] in BAD]
        assert damage == [], damage
        _mismatch_logged(log)
        assert (st["state"], st["version"]) == ("READY", 1), st
        assert [(e["state"], e["version"]) for e in st["engines"]] == [("STALE", 1)] * 2, st["engines"]
        for p in c.procs[1:]:
            assert not [s for s in finalized_syncs(p) if s.startswith("catchup-")], p.name
        r = ws("status", "--addr", c.addr)  # what an operator reads
        assert r.returncode == 0 and "DIGEST_SCHEME_MISMATCH" in r.stdout, (r.stdout, r.stderr)
        with c.client(timeout=30.0) as client:
            assert client.push(dict(perturbed(tiny_state, 2)).items(), 2).state == "READY"
        c.daemon.popen.send_signal(signal.SIGTERM)
        assert c.daemon.popen.wait(15) == 0
        since = c.daemon.log_path.stat().st_size
        c.start_daemon()
        st = wait_for(
            lambda: s if (s := _status(c)) and [e["state"] for e in s["engines"]] == ["READY"] * 2 else None,
            60,
            "both engines READY at the restarted daemon's version",
        )
        assert (st["state"], st["version"], st["digest_scheme_error"]) == ("READY", 2, None), st
        assert not [
            e for e in _events(c.daemon.log_path, since) if e.get("event") == "digest_scheme_mismatch"
        ]
