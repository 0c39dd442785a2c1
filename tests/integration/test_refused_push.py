"""A `weightsync push` whose begin the daemon refuses says so at once (issue 44, item 3):
nothing began, so there is nothing to wait for, and the age it quotes is fresh."""

from __future__ import annotations

import json
import re
import time

from safetensors.torch import save_file

from examples.tiny import perturbed

from .helpers import running_daemon, ws


def test_a_push_refused_because_a_sync_runs_says_so_at_once_with_a_fresh_age(
    tmp_path, tiny_model_dir, tiny_state
):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(dict(perturbed(tiny_state, 1)), str(d / "model.safetensors"))
    with running_daemon(tmp_path / "fleet", tiny_model_dir, engines=1) as cluster:
        with cluster.client(timeout=10.0) as holder:
            sid = holder.begin(1).sync_id  # a trainer mid-sync, its connection open
            began = time.monotonic()
            # --timeout 120: the old wait for "no sync" would run to it; the subprocess
            # timeout (30 s) is far below it, so that wait fails the test
            r = ws("push", str(d), "--version", "1", "--addr", cluster.addr, "--timeout", "120", timeout=30)
            since = time.monotonic() - began
            assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
            (line,) = r.stderr.strip().splitlines()
            assert "push failed: INVALID_STATE" in line and sid in line, line
            assert f"weightsync abort --sync-id {sid}" in line, line
            age = int(re.search(r"has been running for (\d+)s", line).group(1))
            assert age <= since + 1, (age, since)  # the age when it was said, not a timeout later
            r = ws(
                "push",
                str(d),
                "--version",
                "1",
                "--addr",
                cluster.addr,
                "--timeout",
                "120",
                "--json",
                timeout=30,
            )
            since = time.monotonic() - began
            err = json.loads(r.stdout)
            assert r.returncode == 4 and err["code"] == "INVALID_STATE", r
            assert err["details"]["running_sync_id"] == sid
            assert err["details"]["running_seconds"] <= since, (err, since)
            assert "settled" not in err["details"]  # nothing began: nothing waited for
            st = cluster.status()  # the running sync is untouched by the refusals
            assert st["sync"]["sync_id"] == sid and st["state"] == "LOADING_BUCKETS", st
            holder.abort(sid, reason="test done")
