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
