"""The fault matrix: real daemon, real engine processes, real signals.

Each scenario asserts its outcome (final state, error code, every engine's digest equal
to a known version's, finalize counts) and records it as a row of docs/RELIABILITY.md
(`python -m tests.faults.report` regenerates that file from these rows).
"""

from __future__ import annotations

import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from examples.tiny import perturbed
from messages.buckets import digest, iter_buckets
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.helpers import HANG_DAEMON, STALLING_TRAINER, running_daemon

pytestmark = pytest.mark.slow
BUCKET = 128 * 1024


def wait_status(cluster, pred, timeout=40.0):
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        try:
            st = cluster.status()
        except WeightSyncError:
            st = None
        if st is not None and pred(st):
            return st
        time.sleep(0.1)
    raise AssertionError(f"condition not reached within {timeout}s; last status: {st}")


def proc(cluster, name):
    return next(p for p in cluster.procs if p.name == name and p.popen.poll() is None)


def row(cluster, scenario, *, code, want_digest, t0, spool=True, note=""):
    """The scenario's outcome as the matrix shows it (and as the test asserts it)."""
    st = cluster.status()
    live = [e for e in st["engines"] if e["state"] != "LOST"]
    return {
        "scenario": scenario,
        "spool": spool,
        "state": st["state"],
        "version": st["version"],
        "dirty": st["dirty"],
        "code": code,
        "digests_ok": bool(live) and all(e["digest"] == want_digest for e in live),
        "finalize_counts": {e["engine_id"]: e["finalize_count"] for e in live},
        "recovered_s": round(time.monotonic() - t0, 2),
        "note": note,
    }


def spool_args(tmp_path, *extra):
    return [*HANG_DAEMON, "--spool", str(tmp_path / "spool"), *extra]


def push(client, state, v, **kw):
    w = dict(perturbed(state, v))
    return client.push(w.items(), v, bucket_bytes=BUCKET, **kw), digest(w.items())


def begin_v2(client, state):
    """v1 READY, then v2 begun: (v1's digest, v2 weights, v2's buckets, sync_id)."""
    _, d1 = push(client, state, 1)
    w2 = dict(perturbed(state, 2))
    return d1, w2, list(iter_buckets(w2.items(), BUCKET)), client.begin(2).sync_id


def test_engine_sigkill_during_loading_rolls_back(tmp_path, tiny_model_dir, tiny_state, matrix_row):
    with (
        running_daemon(tmp_path, tiny_model_dir, daemon_args=spool_args(tmp_path)) as c,
        c.client(timeout=30.0) as client,
    ):
        d1, _, buckets, sid = begin_v2(client, tiny_state)
        client.send_bucket(sid, buckets[0])
        proc(c, "engine-1").popen.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as ei:
            for b in buckets[1:]:
                client.send_bucket(sid, b)
        assert ei.value.code is ErrorCode.ENGINE_FAILED
        # the survivor is rolled back at once (min_engines gates new syncs, not recovery) ...
        st = wait_status(c, lambda s: s["state"] == "READY" and s["version"] == 1)
        assert [e["engine_id"] for e in st["engines"] if e["state"] == "READY"] == ["engine-0"]
        c.start_engine("engine-1")  # ... and the replacement catches up from the spool
        st = wait_status(
            c,
            lambda s: (
                s["state"] == "READY"
                and sorted(e["engine_id"] for e in s["engines"] if e["state"] == "READY")
                == ["engine-0", "engine-1"]
            ),
        )
        r = row(
            c,
            "engine SIGKILL in LOADING_BUCKETS",
            code=ei.value.code.value,
            want_digest=d1,
            t0=t0,
            note="survivor rolled back from the spool at once; the replacement caught up from it",
        )
        assert (st["version"], r["digests_ok"]) == (1, True)
        assert r["finalize_counts"] == {"engine-0": 2, "engine-1": 1}  # v1 + rollback; new process: rollback
        matrix_row(r)


def test_engine_sigkill_during_finalizing_rolls_back(tmp_path, tiny_model_dir, tiny_state, matrix_row):
    with running_daemon(
        tmp_path, tiny_model_dir, engines=1, min_engines=2, daemon_args=spool_args(tmp_path)
    ) as c:
        c.start_engine(
            "engine-1", ["--threads", "1", "--heartbeat-interval", "0.5", "--failpoint", "finalize_sleep=2"]
        )
        c.wait_engines(2)
        with c.client(timeout=30.0) as client:
            r1, d1 = push(client, tiny_state, 1)
        errors: list[WeightSyncError] = []

        def trainer():
            with c.client(timeout=30.0) as t:
                try:
                    push(t, tiny_state, 2)
                except WeightSyncError as err:
                    errors.append(err)

        th = threading.Thread(target=trainer)
        th.start()
        wait_status(c, lambda s: s["state"] == "FINALIZING", timeout=20)
        proc(c, "engine-1").popen.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        th.join(30)
        assert [e.code for e in errors] == [ErrorCode.ENGINE_FAILED]
        # the survivor is rolled back at once (min_engines gates new syncs, not recovery) ...
        st = wait_status(c, lambda s: s["state"] == "READY" and s["version"] == 1)
        assert [e["engine_id"] for e in st["engines"] if e["state"] == "READY"] == ["engine-0"]
        c.start_engine("engine-1", ["--threads", "1", "--heartbeat-interval", "0.5"])
        st = wait_status(  # ... and the replacement catches up from the spool
            c,
            lambda s: (
                s["state"] == "READY"
                and sorted(e["engine_id"] for e in s["engines"] if e["state"] == "READY")
                == ["engine-0", "engine-1"]
            ),
        )
        r = row(
            c,
            "engine SIGKILL in FINALIZING",
            code=errors[0].code.value,
            want_digest=d1,
            t0=t0,
            note="killed inside a 2 s post-load step; survivor rolled back at once, replacement caught up",
        )
        assert (st["version"], r["digests_ok"]) == (1, True)
        # engine-0 finalized v1, v2 (the failed sync) and the rollback: once each
        assert r["finalize_counts"] == {"engine-0": 3, "engine-1": 1}
        matrix_row(r)


def test_engine_hung_past_deadline_fails_then_rejoins_the_rollback(
    tmp_path, tiny_model_dir, tiny_state, matrix_row
):
    with (
        running_daemon(tmp_path, tiny_model_dir, daemon_args=spool_args(tmp_path)) as c,
        c.client(timeout=30.0) as client,
    ):
        d1, _, buckets, sid = begin_v2(client, tiny_state)
        client.send_bucket(sid, buckets[0])
        hung = proc(c, "engine-1").popen
        hung.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(WeightSyncError) as ei:
                for b in buckets[1:]:
                    client.send_bucket(sid, b)
            assert ei.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in ei.value.message
            assert time.monotonic() - t0 < 15  # the 3 s engine deadline, not a wedge
        finally:
            hung.send_signal(signal.SIGCONT)  # it wakes up, is told it is unknown, re-registers
        # it joins the rollback if it registered again before that began, else a catch-up
        # right after it (on a busy host either): READY, both engines serving version 1
        st = wait_status(
            c,
            lambda s: (
                s["state"] == "READY"
                and sorted((e["engine_id"], e["state"], e["version"]) for e in s["engines"])
                == [("engine-0", "READY", 1), ("engine-1", "READY", 1)]
            ),
        )
        r = row(
            c,
            "engine hung (SIGSTOP) past its deadline",
            code=ei.value.code.value,
            want_digest=d1,
            t0=t0,
            note="SIGCONT after the failure: re-registers and joins the rollback or catches up after it",
        )
        assert (st["version"], r["digests_ok"]) == (1, True)
        assert r["finalize_counts"] == {"engine-0": 2, "engine-1": 2}
        matrix_row(r)


def test_trainer_sigkill_mid_sync_is_seen_and_rolls_back(tmp_path, tiny_model_dir, tiny_state, matrix_row):
    """The trainer's connection closes: the sync ends after the 2 s grace (the sync
    deadline stays at its 300 s default), then the spool rolls the engines back."""
    args = spool_args(tmp_path)
    with running_daemon(tmp_path, tiny_model_dir, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            r1, d1 = push(client, tiny_state, 1)
        p = subprocess.Popen(
            [sys.executable, "-c", STALLING_TRAINER, c.addr, str(tiny_model_dir), "2", "inline"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "STREAMING"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        t0 = time.monotonic()
        st = wait_status(c, lambda s: s["state"] == "READY" and s["last_sync"]["kind"] == "rollback")
        code = st["last_sync"]["rolled_back_from"]["code"]
        r = row(
            c,
            "trainer SIGKILL mid-sync",
            code=code,
            want_digest=d1,
            t0=t0,
            note="connection closed, 2 s grace, then rollback",
        )
        assert (code, st["version"], r["digests_ok"]) == ("ABORTED", 1, True)
        assert "connection closed" in st["last_sync"]["rolled_back_from"]["reason"]
        assert r["finalize_counts"] == {"engine-0": 2, "engine-1": 2}
        matrix_row(r)


@pytest.mark.parametrize("spool", [True, False], ids=["spool", "no-spool"])
def test_daemon_sigkill_mid_sync_then_restart(tmp_path, tiny_model_dir, tiny_state, matrix_row, spool):
    args = spool_args(tmp_path) if spool else HANG_DAEMON
    with running_daemon(tmp_path, tiny_model_dir, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            r1, d1 = push(client, tiny_state, 1)
            sid = client.begin(2).sync_id
            for b in list(iter_buckets(dict(perturbed(tiny_state, 2)).items(), BUCKET))[:3]:
                client.send_bucket(sid, b)
        c.daemon.popen.send_signal(signal.SIGKILL)
        c.daemon.popen.wait(10)
        t0 = time.monotonic()
        c.start_daemon()
        if spool:
            # READY, and both engines back at the served version: under load one engine may
            # re-register after the rollback and catch up from the spool a moment later
            st = wait_status(
                c,
                lambda s: (
                    s["state"] == "READY"
                    and [(e["state"], e["version"]) for e in s["engines"]] == [("READY", 1)] * 2
                ),
            )
            r = row(
                c,
                "daemon SIGKILL mid-sync, restart",
                code="-",
                want_digest=d1,
                t0=t0,
                note="journal: interrupted sync -> IDLE dirty; engines re-register; rollback",
            )
            assert (st["version"], st["dirty"], r["digests_ok"]) == (1, False, True)
            assert st["spool"]["version"] == 1 and st["last_sync"]["kind"] == "rollback"
            assert r["finalize_counts"] == {"engine-0": 2, "engine-1": 2}
        else:
            st = wait_status(c, lambda s: len([e for e in s["engines"] if e["state"] != "LOST"]) == 2)
            r = row(
                c,
                "daemon SIGKILL mid-sync, restart",
                code="-",
                want_digest=None,
                t0=t0,
                spool=False,
                note="no spool: IDLE dirty until the next sync",
            )
            assert (st["state"], st["dirty"], st["version"], st["last_ready_version"]) == (
                "IDLE",
                True,
                None,
                1,
            )
            r["digests_ok"] = None  # engines hold a mix, and say so (digest unknown)
            with c.client(timeout=30.0) as client:
                r3, d3 = push(client, tiny_state, 3)
            assert {e["digest"] for e in r3.engines} == {d3}
        matrix_row(r)


def test_duplicate_resent_and_reordered_buckets_apply_once(tmp_path, tiny_model_dir, tiny_state, matrix_row):
    with (
        running_daemon(tmp_path, tiny_model_dir, daemon_args=spool_args(tmp_path)) as c,
        c.client(timeout=30.0) as client,
    ):
        _, w2, buckets, sid = begin_v2(client, tiny_state)
        t0 = time.monotonic()
        for b in reversed(buckets):  # reordered
            client.send_bucket(sid, b)
        again = client.send_bucket(sid, buckets[2])  # resent after its ack
        assert again.get("duplicate") is True
        body = client.finish(sid, len(buckets), digest=digest(w2.items()))
        assert body.status == "READY"
        r = row(
            c,
            "duplicate, resent and reordered buckets",
            code="-",
            want_digest=digest(w2.items()),
            t0=t0,
            note="reverse order, one bucket resent after its ack",
        )
        assert r["finalize_counts"] == {"engine-0": 2, "engine-1": 2} and r["digests_ok"]
        matrix_row(r)


def test_corrupted_bucket_is_refused_and_the_retry_succeeds(tmp_path, tiny_model_dir, tiny_state, matrix_row):
    with (
        running_daemon(tmp_path, tiny_model_dir, daemon_args=spool_args(tmp_path)) as c,
        c.client(timeout=30.0) as client,
    ):
        _, w2, buckets, sid = begin_v2(client, tiny_state)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as ei:
            client.send_bucket(sid, buckets[0], checksum=buckets[0].checksum ^ 1)
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH
        assert client.status()["state"] == "LOADING_BUCKETS"  # nothing applied, sync goes on
        for b in buckets:
            client.send_bucket(sid, b)
        assert client.finish(sid, len(buckets), digest=digest(w2.items())).status == "READY"
        r = row(
            c,
            "corrupted bucket",
            code=ei.value.code.value,
            want_digest=digest(w2.items()),
            t0=t0,
            note="refused before fan-out; the trainer resends it",
        )
        assert r["digests_ok"] and r["finalize_counts"] == {"engine-0": 2, "engine-1": 2}
        matrix_row(r)


def test_finalize_duplicated_on_the_engine_link_runs_once(tmp_path, tiny_model_dir, tiny_state, matrix_row):
    args = spool_args(tmp_path, "--failpoint", "duplicate_finalize")
    with running_daemon(tmp_path, tiny_model_dir, daemon_args=args) as c, c.client(timeout=30.0) as client:
        t0 = time.monotonic()
        push(client, tiny_state, 1)
        r2, d2 = push(client, tiny_state, 2)
        time.sleep(0.5)  # let the duplicates arrive and be refused
        r = row(
            c,
            "finalize duplicated on the engine link",
            code="-",
            want_digest=d2,
            t0=t0,
            note="daemon failpoint sends every finalize twice; the worker guard refuses",
        )
        assert r["digests_ok"] and r["finalize_counts"] == {"engine-0": 2, "engine-1": 2}
        refused = sum(
            p.log_path.read_text().count("duplicate_finalize_refused")
            for p in c.procs
            if p.name.startswith("engine")
        )
        assert refused == 4
        matrix_row(r)


@pytest.mark.parametrize("how", ["unwritable", "file-size-limit"])
def test_spool_write_failure_degrades_without_failing_syncs(
    tmp_path, tiny_model_dir, tiny_state, matrix_row, how
):
    spool = tmp_path / "spool"
    with (
        running_daemon(tmp_path, tiny_model_dir, daemon_args=spool_args(tmp_path)) as c,
        c.client(timeout=30.0) as client,
    ):
        push(client, tiny_state, 1)
        assert client.status()["spool"]["version"] == 1
        if how == "unwritable":
            shutil.rmtree(spool)
            spool.write_text("not a directory")  # every spool write now fails (ENOTDIR)
        else:
            limit = 512 * 1024  # smaller than a 1 MiB bucket file: writes fail with EFBIG
            resource.prlimit(c.daemon.popen.pid, resource.RLIMIT_FSIZE, (limit, limit))
        t0 = time.monotonic()
        w2 = dict(perturbed(tiny_state, 2))
        r2 = client.push(w2.items(), 2, bucket_bytes=1 << 20)
        assert r2.state == "READY"  # the sync itself is not failed by the spool
        sp = client.status()["spool"]
        assert sp["state"] == "degraded" and sp["version"] is None and "version 2" in sp["error"]
        # with nothing to roll back to, a failed sync leaves IDLE dirty, and says so
        sid = client.begin(3).sync_id
        client.send_bucket(sid, list(iter_buckets(dict(perturbed(tiny_state, 3)).items(), BUCKET))[0])
        client.abort(sid, "test")
        st = wait_status(c, lambda s: s["state"] == "IDLE")
        assert st["dirty"] is True and st["last_sync"]["rollback"] == "none"
        errno = re.search(r"\[Errno \d+\] [^:']+", sp["error"])
        r = row(
            c,
            f"spool {how}",
            code=st["last_sync"]["code"],
            want_digest=None,
            t0=t0,
            note=f"sync v2 READY, spool degraded ({errno.group(0) if errno else sp['error']}); "
            "a later failure: IDLE dirty",
        )
        r["digests_ok"] = None
        matrix_row(r)
