"""What a new operator hits, through the CLI: each case as it was reported, now handled.

1 small /dev/shm, 2 an orphaned sync, 3 two daemons on one state, 4 a duplicate engine id,
5 bad arguments, files and addresses, 6 silent waits, 7 late blame for missing tensors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from engines.sink import random_weights, synthetic_spec, write_spec
from examples.launch import Cluster, spawn
from examples.tiny import perturbed
from messages.errors import ErrorCode, WeightSyncError

from .helpers import FAST_DAEMON, running_daemon, sigint_default, ws

pytestmark = pytest.mark.slow


def one_line_error(r, code):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def wait_for(pred, timeout=20.0, every=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    return pred()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with running_daemon(tmp_path_factory.mktemp("op"), tiny_model_dir, engines=1) as c:
        yield c


def checkpoint(tmp_path: Path, tiny_state, version: int, *, keep=None) -> Path:
    d = tmp_path / f"ckpt-{version}-{'part' if keep else 'full'}"
    d.mkdir()
    items = [(k, v) for k, v in perturbed(tiny_state, version) if keep is None or keep(k)]
    save_file(dict(items), str(d / "model.safetensors"))
    return d


def next_version(c) -> int:
    return (c.status()["last_ready_version"] or 0) + 1


# -- 1 ------------------------------------------------------------------------------------


@pytest.fixture
def small_shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(d)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a private 64 MiB tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_1_push_with_64mib_buckets_into_a_64mib_shm_falls_back_to_inline(tmp_path, small_shm):
    """Reserving the slots up front fails cleanly (ENOSPC), so the push goes inline: no
    SIGBUS, no leaked segment, READY."""
    spec = synthetic_spec(80 << 20, tensor_bytes=40 << 20)
    model = write_spec(tmp_path / "sink", spec)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(dict(random_weights(spec, seed=3)), str(ckpt / "model.safetensors"))
    c = Cluster(
        tmp_path / "d",
        model,
        engines=1,
        backend="sink",
        daemon_args=[*FAST_DAEMON, "--shm-dir", str(small_shm)],
        engine_args=["--shm-dir", str(small_shm)],
    )
    with c:
        r = ws(
            "push",
            str(ckpt),
            "--version",
            "1",
            "--addr",
            c.addr,
            "--bucket-bytes",
            str(64 << 20),
            "--shm-dir",
            str(small_shm),
            "--json",
        )
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        assert out["state"] == "READY" and out["transport"] == "inline"
        assert os.listdir(small_shm) == []
        assert c.status()["state"] == "READY"


def test_1_the_automatic_window_gets_the_ring_a_small_shm_has_room_for(tmp_path, small_shm, monkeypatch):
    """16 MiB buckets: the automatic window would like 8 slots (128 MiB), the 64 MiB tmpfs
    holds at most 4; the push goes by shm with the smaller ring and a window within it,
    READY, and the slots are released when the client closes."""
    from messages import segments

    spec = synthetic_spec(96 << 20, tensor_bytes=16 << 20)
    model = write_spec(tmp_path / "sink", spec)
    monkeypatch.setattr(segments, "_DIR", Path(small_shm))
    c = Cluster(
        tmp_path / "d",
        model,
        engines=1,
        backend="sink",
        daemon_args=[*FAST_DAEMON, "--shm-dir", str(small_shm)],
        engine_args=["--shm-dir", str(small_shm)],
    )
    with c, c.client(timeout=30.0) as client:
        r = client.push(list(random_weights(spec, seed=4)), 1, bucket_bytes=16 << 20)
        assert r.state == "READY" and r.detail["transport"] == "shm"
        slots = sorted(os.listdir(small_shm))
        assert 2 <= len(slots) <= 4 and 2 <= r.detail["window"] <= len(slots)
        # the next push reuses that smaller ring rather than asking the tmpfs again
        r = client.push(list(random_weights(spec, seed=5)), 2, bucket_bytes=16 << 20)
        assert r.state == "READY" and sorted(os.listdir(small_shm)) == slots
    assert os.listdir(small_shm) == []


# -- 2 ------------------------------------------------------------------------------------


def test_2_a_begin_blocked_by_a_running_sync_names_it_and_weightsync_abort_ends_it(
    cluster, tmp_path, tiny_state
):
    v = next_version(cluster)
    with cluster.client(timeout=10.0) as holder:
        sid = holder.begin(v).sync_id  # a trainer that went quiet, connection still open
        d = checkpoint(tmp_path, tiny_state, v)
        r = ws("push", str(d), "--version", str(v), "--addr", cluster.addr, "--json")
        assert r.returncode == 4
        err = json.loads(r.stdout)
        assert err["code"] == "INVALID_STATE" and sid in err["message"]
        assert "weightsync abort" in err["message"] and err["details"]["running_sync_id"] == sid
        r = ws("abort", "--addr", cluster.addr, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["aborted"] == sid
        r = ws("push", str(d), "--version", str(v), "--addr", cluster.addr)
        assert r.returncode == 0, r.stderr
        with pytest.raises(WeightSyncError) as ei:  # finish outside LOADING_BUCKETS, with the cause
            holder.finish(sid, 0, timeout=5)
        assert ei.value.code is ErrorCode.INVALID_STATE
        assert "already ended: ABORTED" in ei.value.message and "operator" in ei.value.message
        with pytest.raises(WeightSyncError) as ei:  # a bucket hears the sync's own outcome
            holder.abort(sid, timeout=5)
        assert ei.value.code is ErrorCode.ABORTED and ei.value.details["ended"] is True


def test_2_an_interrupted_push_releases_its_sync(cluster, tmp_path, tiny_model_dir):
    from tests.integration.helpers import STALLING_TRAINER

    v = next_version(cluster)
    p = subprocess.Popen(
        [sys.executable, "-c", STALLING_TRAINER, cluster.addr, str(tiny_model_dir), str(v), "inline"],
        preexec_fn=sigint_default,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "STREAMING"
    p.send_signal(signal.SIGINT)  # the client aborts what it began on the way out
    p.wait(30)
    last = wait_for(lambda: (s := cluster.status())["sync"] is None and s["last_sync"], timeout=10)
    assert last["status"] == "ABORTED" and last["by"] == "trainer", last
    assert last["reason"] == "sync aborted by the trainer: trainer error: interrupted (Ctrl-C or SIGTERM)", (
        last
    )


# -- 3 ------------------------------------------------------------------------------------


def test_3_a_second_daemon_on_the_same_state_or_spool_exits_3_naming_the_holder(tmp_path):
    spool = tmp_path / "spool"
    c = Cluster(
        tmp_path / "a",
        None,
        engines=0,
        min_engines=1,
        daemon_args=["--spool", str(spool), "--log-level", "error"],
    )
    with c:
        line = one_line_error(
            ws(
                "serve",
                "--bind",
                f"ipc://{tmp_path}/b.sock",
                "--engine-bind",
                f"ipc://{tmp_path}/be.sock",
                "--state-db",
                str(c.state_db),
            ),
            3,
        )
        assert f"pid {c.daemon.popen.pid}" in line and "state db" in line
        line = one_line_error(
            ws(
                "serve",
                "--bind",
                f"ipc://{tmp_path}/b.sock",
                "--engine-bind",
                f"ipc://{tmp_path}/be.sock",
                "--state-db",
                str(tmp_path / "other.db"),
                "--spool",
                str(spool),
            ),
            3,
        )
        assert f"pid {c.daemon.popen.pid}" in line and "spool" in line
        st = c.status()
        assert st["spool"]["state"] in ("ok", "empty") and st["spool"]["error"] is None


# -- 4 ------------------------------------------------------------------------------------


def test_4_a_duplicate_engine_id_is_refused_and_a_dead_ones_restart_rejoins(cluster):
    before = {e["engine_id"]: e for e in cluster.status()["engines"]}
    holder = before["engine-0"]
    dup = spawn(
        "dup-engine",
        [
            "engine",
            "--backend",
            "torch",
            "--model",
            str(cluster.model_dir),
            "--connect",
            cluster.engine_addr,
            "--engine-id",
            "engine-0",
            "--threads",
            "1",
        ],
        cluster.log_dir,
    )
    assert dup.popen.wait(60) == 3
    log = dup.log_path.read_text()
    assert f"pid {holder['pid']}" in log and "held by a live engine" in log
    after = {e["engine_id"]: e for e in cluster.status()["engines"]}
    assert after["engine-0"]["pid"] == holder["pid"] and after["engine-0"]["state"] == holder["state"]
    # a dead engine's restart under its id is a rejoin, not a duplicate
    old = next(p for p in cluster.procs if p.name == "engine-0")
    os.killpg(old.popen.pid, signal.SIGKILL)
    old.popen.wait(10)
    new = cluster.start_engine("engine-0")
    st = wait_for(
        lambda: (
            (s := cluster.status())
            and any(e["engine_id"] == "engine-0" and e["pid"] == new.popen.pid for e in s["engines"])
            and s
        ),
        60,
    )
    assert st, cluster.status()


# -- 5 ------------------------------------------------------------------------------------


def test_5_bad_arguments_files_and_addresses_are_one_line_with_documented_codes(tmp_path, tiny_state):
    good = checkpoint(tmp_path, tiny_state, 1)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (good / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    twice = tmp_path / "twice"
    twice.mkdir()
    for i in range(2):
        (twice / f"m{i}.safetensors").write_bytes(data)
    addr = f"ipc://{tmp_path}/nobody.sock"
    for args, code, words in [
        (("push", str(corrupt), "--version", "1", "--addr", addr), 2, "not a readable safetensors"),
        (("push", str(truncated), "--version", "1", "--addr", addr), 2, "not a readable safetensors"),
        (("push", str(twice), "--version", "1", "--addr", addr), 2, "appears in both"),
        (("push", str(good), "--version", "1", "--addr", "nonsense"), 2, "--addr"),
        (("status", "--addr", "tcp://no-port"), 2, "--addr"),
        (
            (
                "serve",
                "--state-db",
                str(tmp_path),
                "--bind",
                f"ipc://{tmp_path}/s.sock",
                "--engine-bind",
                f"ipc://{tmp_path}/e.sock",
            ),
            3,
            "--state-db",
        ),
        (("engine", "--model", str(tmp_path), "--connect", "nonsense"), 2, "--connect"),
    ]:
        line = one_line_error(ws(*args), code)
        assert words in line, (args, line)
    for args in [
        ("push", str(good), "--version", "1", "--window", "0"),
        ("push", str(good), "--version", "1", "--bucket-bytes", "0"),
        ("push", str(good), "--version", str(2**63)),
        ("push", str(good), "--version", "1", "--timeout", "0"),
        ("status", "--watch", "-1"),
    ]:
        r = ws(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
    assert "(default" in ws("serve", "--help").stdout


# -- 6 ------------------------------------------------------------------------------------


def test_6_no_daemon_is_said_within_seconds(tmp_path, tiny_state):
    d = checkpoint(tmp_path, tiny_state, 1)
    t0 = time.monotonic()
    r = ws("push", str(d), "--version", "1", "--addr", "tcp://127.0.0.1:9")
    assert time.monotonic() - t0 < 30
    line = one_line_error(r, 4)
    assert "UNREACHABLE" in line and "no daemon at tcp://127.0.0.1:9" in line


def test_6_a_sync_lost_to_a_daemon_restart_is_unknown_and_says_begin_again(
    tmp_path, tiny_model_dir, tiny_state
):
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c:
        with c.client(timeout=30.0) as client:
            sid = client.begin(1).sync_id
            os.killpg(c.daemon.popen.pid, signal.SIGKILL)
            c.daemon.popen.wait(10)
            c.start_daemon()
            c.wait_engines(1)
            from messages.buckets import iter_buckets

            (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, 1)).items(), 64 * 1024))
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as ei:
                client.send_bucket(sid, b)
            assert time.monotonic() - t0 < 10
            assert ei.value.code is ErrorCode.UNKNOWN_SYNC and "restarted" in ei.value.message


def test_6_an_engine_without_a_daemon_says_what_it_waits_for(tmp_path, tiny_model_dir):
    p = spawn(
        "lonely",
        [
            "engine",
            "--model",
            str(tiny_model_dir),
            "--connect",
            f"ipc://{tmp_path}/none.sock",
            "--engine-id",
            "lonely",
            "--threads",
            "1",
        ],
        tmp_path,
    )
    try:
        assert wait_for(lambda: "waiting_for_orchestrator" in p.log_path.read_text(), timeout=60)
    finally:
        p.stop()


# -- 7 ------------------------------------------------------------------------------------


def test_7_missing_tensors_are_refused_at_finish_before_any_finalize(cluster, tmp_path, tiny_state):
    v = next_version(cluster)
    before = {e["engine_id"]: e["finalize_count"] for e in cluster.status()["engines"]}
    half = checkpoint(tmp_path, tiny_state, v, keep=lambda k: "layers.1." not in k)
    r = ws("push", str(half), "--version", str(v), "--addr", cluster.addr, "--json")
    assert r.returncode == 4
    err = json.loads(r.stdout)
    assert err["code"] == "INCOMPLETE_SYNC" and err["details"]["engine_id"] == "engine-0"
    assert "push with --partial" in err["message"], err["message"]  # the CLI's own flag
    assert all("layers.1." in n for n in err["details"]["missing"]) and err["details"]["missing_count"] > 0
    after = {e["engine_id"]: e["finalize_count"] for e in cluster.status()["engines"]}
    assert after == before  # nothing was finalized
    full = checkpoint(tmp_path, tiny_state, v)
    r = ws("push", str(full), "--version", str(v), "--addr", cluster.addr)
    assert r.returncode == 0, r.stderr  # the trainer can retry with the whole checkpoint
