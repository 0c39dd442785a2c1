"""The `weightsync` command as users and scripts run it: real processes, real exit codes."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from examples.tiny import perturbed
from messages.buckets import digest

from .helpers import running_daemon, ws


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with running_daemon(tmp_path_factory.mktemp("cli"), tiny_model_dir) as c:
        yield c


def checkpoint(tmp_path, tiny_state, version, shards=2):
    d = tmp_path / f"ckpt-v{version}"
    d.mkdir()
    items = list(perturbed(tiny_state, version))
    for i in range(shards):
        save_file(dict(items[i::shards]), str(d / f"model-{i:05d}.safetensors"))
    return d, dict(items)


def test_push_then_status_json_then_stale_push_fails_with_code(cluster, tmp_path, tiny_state):
    # the module's tests share one cluster and run in any order: count from where it is
    before = json.loads(ws("status", "--addr", cluster.addr, "--json").stdout)
    v = (before["last_ready_version"] or 0) + 1
    counts = [e["finalize_count"] for e in before["engines"]]
    d, weights = checkpoint(tmp_path, tiny_state, v)
    r = ws("push", str(d), "--version", str(v), "--addr", cluster.addr, "--bucket-bytes", "200000")
    assert r.returncode == 0, r.stderr
    assert "READY" in r.stdout and digest(weights.items()) in r.stdout

    r = ws("status", "--addr", cluster.addr, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert (st["state"], st["version"], st["dirty"], st["sync"]) == ("READY", v, False, None)
    assert [e["finalize_count"] for e in st["engines"]] == [c + 1 for c in counts]
    assert {e["backend"] for e in st["engines"]} == {"torch"}
    assert st["history"][-1]["to"] == "READY" and st["history"][-1]["version"] == v

    r = ws("push", str(d), "--version", str(v), "--addr", cluster.addr)
    assert r.returncode == 4
    assert "STALE_VERSION" in r.stderr


def test_status_table_is_readable(cluster):
    r = ws("status", "--addr", cluster.addr)
    assert r.returncode == 0, r.stderr
    assert "engine-0" in r.stdout and "engine-1" in r.stdout and "finalize" in r.stdout


def test_status_against_no_daemon_fails_with_timeout_code(tmp_path):
    r = ws("status", "--addr", f"ipc://{tmp_path}/nobody.sock", "--timeout", "0.5")
    assert r.returncode == 4 and "TIMEOUT" in r.stderr


def test_push_of_a_directory_without_safetensors_is_a_usage_error(cluster, tmp_path):
    r = ws("push", str(tmp_path), "--version", "9", "--addr", cluster.addr)
    assert r.returncode == 2 and "no *.safetensors" in r.stderr


def test_bad_environment_setting_is_a_config_error(tmp_path):
    from orchestrator.daemon.config import child_env

    r = ws("serve", "--state-db", str(tmp_path / "s.db"), env=child_env({"WEIGHTSYNC_MIN_ENGINES": "two"}))
    assert r.returncode == 2 and "WEIGHTSYNC_MIN_ENGINES" in r.stderr


def test_serve_on_a_live_ipc_path_is_a_startup_failure_and_does_not_steal_it(cluster, tmp_path):
    r = ws(
        "serve",
        "--bind",
        cluster.addr.replace("trainer", "other"),
        "--engine-bind",
        cluster.engine_addr,
        "--state-db",
        str(tmp_path / "s.db"),
        timeout=60,
    )
    assert r.returncode == 3 and "in use" in r.stderr, (r.stdout, r.stderr)
    assert len(cluster.status()["engines"]) == 2  # the running daemon still has its engines


def test_serve_on_a_taken_tcp_port_is_a_startup_failure_that_leaves_no_state_files(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        (tmp_path / "kept.txt").write_text("mine")
        r = ws(
            "serve",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--engine-bind",
            "tcp://127.0.0.1:0",
            "--state-db",
            str(tmp_path / "s.db"),
            "--spool",
            str(tmp_path / "spool"),
            timeout=60,
        )
    assert r.returncode == 3 and "startup failed" in r.stderr, (r.stdout, r.stderr)
    # the journal, its lock and the spool it created are gone; what was there stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def test_push_over_the_collective_from_the_command_line(cluster, tmp_path, tiny_state):
    # the module's tests share one cluster and run in any order: nothing may have been served
    v = (json.loads(ws("status", "--addr", cluster.addr, "--json").stdout)["last_ready_version"] or 0) + 1
    d, weights = checkpoint(tmp_path, tiny_state, v)
    r = ws(
        "push",
        str(d),
        "--version",
        str(v),
        "--addr",
        cluster.addr,
        "--transport",
        "collective",
        "--collective-host",
        "127.0.0.1",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["transport"] == "collective" and out["digest"] == digest(weights.items())
    # the group's store was this push's: status shows the group while a trainer holds it
    # (test_cli_details.py::test_status_shows_a_collective_group_only_while_its_trainer_is_connected)
