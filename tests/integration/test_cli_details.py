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


def test_an_address_without_its_scheme_is_one_line_naming_the_address_meant(tmp_path):
    """`--addr 127.0.0.1:25555` and friends: exit 2 at once with the `tcp://` (or `ipc://`)
    address the user most likely meant; a daemon given one takes no state first."""
    model = tmp_path / "model"
    model.mkdir()
    runs = {
        "status": ws("status", "--addr", "127.0.0.1:25555", timeout=30),
        "abort": ws("abort", "--addr", "localhost:25555", timeout=30),
        "engine": ws("engine", "--model", str(model), "--connect", "127.0.0.1:25556", timeout=30),
        "serve": ws("serve", "--bind", "*:25555", "--state-db", str(tmp_path / "s.db"), timeout=30),
        "serve ipc": ws("serve", "--engine-bind", f"{tmp_path}/e.sock", "--state-db", str(tmp_path / "s.db")),
    }
    meant = {
        "status": "'tcp://127.0.0.1:25555'",
        "abort": "'tcp://localhost:25555'",
        "engine": "'tcp://127.0.0.1:25556'",
        "serve": "'tcp://*:25555'",
        "serve ipc": f"'ipc://{tmp_path}/e.sock'",
    }
    for what, r in runs.items():
        assert r.returncode == 2, (what, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (what, r.stderr)
        assert f"did you mean {meant[what]}?" in r.stderr, (what, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no journal, no lock


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()]


def test_tables_through_a_pipe_keep_whole_rows_and_follow_columns(tmp_path):
    """Through a pipe (what scripts, `| grep` and logs see) no cell is cut at rich's 80
    columns; with COLUMNS set, `config show` and `status` draw to that width."""
    from .helpers import running_daemon

    piped = ws("config", "show", "serve", env=child_env({"COLUMNS": ""}))
    assert piped.returncode == 0, piped.stderr
    assert "…" not in piped.stdout and "WEIGHTSYNC_FANOUT_QUEUE_BYTES" in piped.stdout
    assert max(len(ln) for ln in _lines(piped.stdout)) > 80
    narrow = ws("config", "show", "serve", env=child_env({"COLUMNS": "70"}))
    assert narrow.returncode == 0 and max(len(ln) for ln in _lines(narrow.stdout)) <= 70, narrow.stdout

    with running_daemon(tmp_path, None, engines=0, min_engines=0) as c:
        wide = ws("status", "--addr", c.addr, env=child_env({"COLUMNS": ""}))
        assert wide.returncode == 0, wide.stderr
        assert "…" not in wide.stdout and "finalize_count" in wide.stdout
        st = ws("status", "--addr", c.addr, env=child_env({"COLUMNS": "60"}))
    assert st.returncode == 0, st.stderr
    assert max(len(ln) for ln in _lines(st.stdout)) <= 60, st.stdout


def test_a_push_json_failure_names_the_version_pushed_and_the_daemons_apart(tmp_path):
    """`push --json` refused (no engines): `version` is the version pushed, not the
    daemon's (None here), which is `daemon_version` beside `state`."""
    import json

    import torch
    from safetensors.torch import save_file

    from .helpers import running_daemon

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.zeros(4)}, str(ckpt / "model.safetensors"))
    with running_daemon(tmp_path / "d", None, engines=0, min_engines=1) as c:
        r = ws("push", str(ckpt), "--version", "7", "--addr", c.addr, "--json", timeout=60)
    assert r.returncode == 4, (r.stdout, r.stderr)
    out = json.loads(r.stdout)
    assert out["ok"] is False and out["code"] == "NO_ENGINES", out
    assert (out["version"], out["daemon_version"], out["state"]) == (7, None, "IDLE"), out


def test_push_delta_from_a_checkpoint_the_fleet_does_not_serve_is_one_line_naming_it(
    tmp_path, tiny_model_dir, tiny_state
):
    """`push --delta-from WRONG`: the engines refuse the patches and the push goes dense, as
    documented; the user reads one line naming the directory, the version it was taken
    for and the tensor an engine holds otherwise, not an engine failure."""
    from safetensors.torch import save_file

    from examples.tiny import perturbed

    from .helpers import running_daemon, small_step

    served = dict(perturbed(tiny_state, 1))
    for name, weights in (("served", served), ("other", small_step(served, 40))):
        (tmp_path / name).mkdir()
        save_file({k: t.contiguous() for k, t in weights.items()}, str(tmp_path / name / "model.safetensors"))
    with running_daemon(tmp_path / "d", tiny_model_dir, engines=1, engine_args=["--delta-base"]) as c:
        r = ws("push", str(tmp_path / "served"), "--version", "1", "--addr", c.addr)
        assert r.returncode == 0, r.stderr
        r = ws(
            "push", str(tmp_path / "served"), "--version", "2", "--addr", c.addr,
            "--delta-from", str(tmp_path / "other"),
        )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr
    (_, line) = r.stdout.strip().splitlines()
    assert line.startswith(
        f"pushed dense, not as a delta: --delta-from {tmp_path / 'other'} is not the checkpoint "
        "the fleet serves as version 1 (engine-0 holds another "
    ), line
    assert "failed" not in line and "no delta base" not in line


def test_status_shows_a_collective_group_only_while_its_trainer_is_connected(
    tmp_path, tiny_model_dir, tiny_state
):
    """The group's store lives in the trainer: status shows the group (store, ranks) while
    that trainer is connected, and no store once its connection closed (it kept showing
    the address of a push that had exited)."""
    import json

    from examples.tiny import perturbed

    from .helpers import running_daemon, wait_for

    def status() -> dict:
        r = ws("status", "--addr", c.addr, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    with running_daemon(tmp_path, tiny_model_dir) as c:
        with c.client(timeout=30.0, collective_host="127.0.0.1") as client:
            r = client.push(perturbed(tiny_state, 1), 1, transport="collective")
            assert r.state == "READY" and r.detail["transport"] == "collective"
            st = status()
            assert st["collective"]["world_size"] == 3 and st["collective"]["store"].startswith("127.0.0.1:")
            text = ws("status", "--addr", c.addr).stdout
            assert "collective group" in text and "ranks" in text, text
            rows = {line.split()[1]: line.split()[-2] for line in text.splitlines() if "engine-" in line}
            ranks = {eid: str(m["rank"]) for eid, m in st["collective"]["members"].items()}
            assert rows == ranks and sorted(ranks.values()) == ["1", "2"], (rows, ranks, text)
        wait_for(lambda: status()["collective"] is None, 15, "the group gone with its trainer")
        text = ws("status", "--addr", c.addr).stdout
        assert "collective group" not in text and "store" not in text, text
        # the next collective push plans a group of its own and succeeds
        with c.client(timeout=30.0, collective_host="127.0.0.1") as client:
            r = client.push(perturbed(tiny_state, 2), 2, transport="collective")
            assert r.state == "READY" and r.detail["transport"] == "collective"
