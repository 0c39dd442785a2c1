"""Settings precedence and the journal's crash recovery."""

from __future__ import annotations

import pytest

from messages.checksums import DIGEST_SCHEME, LEGACY_DIGEST_SCHEME, UNRECORDED_DIGEST_SCHEME
from orchestrator.daemon.config import ConfigError, load_settings
from orchestrator.daemon.journal import Journal


def test_flags_win_over_env_which_win_over_defaults(monkeypatch):
    assert load_settings().min_engines == 1
    monkeypatch.setenv("WEIGHTSYNC_MIN_ENGINES", "3")
    monkeypatch.setenv("WEIGHTSYNC_ENGINE_TIMEOUT", "2.5")
    s = load_settings()
    assert (s.min_engines, s.engine_timeout) == (3, 2.5)
    assert load_settings(min_engines=5, engine_timeout=None).min_engines == 5


@pytest.mark.parametrize("env", [{"WEIGHTSYNC_MIN_ENGINES": "x"}, {"WEIGHTSYNC_ENGINE_TIMEOUT": "0"}])
def test_bad_settings_raise_config_error(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError):
        load_settings()


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        load_settings().min_engines = 2  # type: ignore[misc]


def _t(j, src, dst, trigger, version, sync_id, dirty=False, code=None):
    j.transition(
        {
            "from": src,
            "to": dst,
            "trigger": trigger,
            "version": version,
            "sync_id": sync_id,
            "at": 1.0,
            "code": code,
        },
        dirty,
    )


def test_fresh_journal_recovers_idle_clean(tmp_path):
    r = Journal(tmp_path / "s.db").recover()
    assert (r.state, r.version, r.dirty, r.interrupted) == ("IDLE", None, False, None)


def test_interrupted_sync_recovers_idle_dirty_with_last_ready(tmp_path):
    path = tmp_path / "s.db"
    j = Journal(path)
    j.sync({"sync_id": "a", "version": 1, "status": "LOADING_BUCKETS"})
    _t(j, "IDLE", "LOADING_BUCKETS", "begin", 1, "a")
    _t(j, "LOADING_BUCKETS", "FINALIZING", "finish", 1, "a")
    _t(j, "FINALIZING", "READY", "finalized", 1, "a")
    j.sync({"sync_id": "a", "version": 1, "status": "READY", "digest": "d1"})
    j.sync({"sync_id": "b", "version": 2, "status": "LOADING_BUCKETS"})
    _t(j, "READY", "LOADING_BUCKETS", "begin", 2, "b")
    j.close()  # the process dies here
    j = Journal(path)
    r = j.recover()
    assert (r.state, r.version, r.digest, r.dirty, r.interrupted) == ("IDLE", 1, "d1", True, "b")
    assert [h["to"] for h in r.history] == ["LOADING_BUCKETS", "FINALIZING", "READY", "LOADING_BUCKETS"]
    assert {s["sync_id"]: s["status"] for s in j.syncs()} == {"a": "READY", "b": "INTERRUPTED"}


def test_failed_sync_recovers_idle_dirty_and_ready_recovers_ready(tmp_path):
    j = Journal(tmp_path / "s.db")
    _t(j, "IDLE", "LOADING_BUCKETS", "begin", 1, "a")
    _t(j, "LOADING_BUCKETS", "IDLE", "fail", 1, "a", dirty=True, code="ENGINE_FAILED")
    r = j.recover()
    assert (r.state, r.dirty, r.interrupted) == ("IDLE", True, None)
    _t(j, "IDLE", "LOADING_BUCKETS", "begin", 2, "b")
    _t(j, "LOADING_BUCKETS", "FINALIZING", "finish", 2, "b")
    _t(j, "FINALIZING", "READY", "finalized", 2, "b")
    assert j.recover().state == "READY"


def test_a_ready_digest_is_recovered_with_its_scheme_and_an_unrecorded_one_is_v5s(tmp_path):
    """The journal keeps the scheme beside the digest; a row an older daemon wrote (no
    digest_scheme column at all) reads as the v5 scheme, and the column is added."""
    path = tmp_path / "s.db"
    j = Journal(path)
    j.sync({"sync_id": "a", "version": 1, "status": "LOADING_BUCKETS"})
    _t(j, "FINALIZING", "READY", "finalized", 1, "a")
    j.sync({"sync_id": "a", "version": 1, "status": "READY", "digest": "d1", "digest_scheme": DIGEST_SCHEME})
    assert (j.recover().digest, j.recover().digest_scheme) == ("d1", DIGEST_SCHEME)
    j.db.execute("ALTER TABLE syncs DROP COLUMN digest_scheme")  # as a v5 daemon left it
    j.close()
    j = Journal(path)
    r = j.recover()
    assert UNRECORDED_DIGEST_SCHEME == LEGACY_DIGEST_SCHEME
    assert (r.version, r.digest, r.digest_scheme) == (1, "d1", LEGACY_DIGEST_SCHEME)
    assert Journal(tmp_path / "fresh.db").recover().digest_scheme is None  # no digest, no scheme
