"""Details of the `weightsync` command a new user meets: help texts, address mistakes,
state files left by a failed start, what scripts read. Real processes, real exit codes."""

from __future__ import annotations

import re

from orchestrator.daemon.config import Settings, child_env

from .helpers import ws


def _help_of(option: str, text: str) -> str:
    """The help text of one option in `--help`, on one line."""
    flat = " ".join(text.split())
    start = flat.index(f"{option} <")
    end = flat.find(" --", start + len(option))
    return flat[start:end]


def test_serve_help_shows_the_daemons_defaults():
    """`serve --help` names the default of every option a user tunes first (they are None
    in the signature so that env and config apply; their help says the daemon's own)."""
    r = ws("serve", "--help", env=child_env({"COLUMNS": "100"}))
    assert r.returncode == 0, r.stderr
    s = Settings()
    for option, value in [
        ("--min-engines", s.min_engines),
        ("--engine-timeout", s.engine_timeout),
        ("--sync-timeout", s.sync_timeout),
        ("--bucket-timeout", s.bucket_timeout),
        ("--finalize-timeout", s.finalize_timeout),
        ("--max-pending", s.max_pending),
    ]:
        shown = re.search(r"\(default ([^)]*)\)", _help_of(option, r.stdout))
        assert shown is not None, (option, _help_of(option, r.stdout))
        assert float(shown.group(1)) == value, (option, shown.group(0))


def test_a_start_refused_by_a_busy_spool_leaves_no_journal_lock_behind(tmp_path):
    """The spool is another daemon's: exit 3 naming its holder, and the `STATE_DB.lock` this
    start made a moment before (its journal was new) is gone again."""
    from orchestrator.daemon.locks import StateLock

    spool = tmp_path / "spool"
    held = StateLock(spool / ".lock", f"spool {spool}").acquire()  # the lock a running daemon holds
    try:
        r = ws(
            "serve",
            "--bind",
            f"ipc://{tmp_path}/t.sock",
            "--engine-bind",
            f"ipc://{tmp_path}/e.sock",
            "--state-db",
            str(tmp_path / "new.db"),
            "--spool",
            str(spool),
            timeout=60,
        )
    finally:
        held.release()
    assert r.returncode == 3 and "in use by another daemon" in r.stderr, (r.stdout, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spool"]
    assert sorted(p.name for p in spool.iterdir()) == [".lock"]
