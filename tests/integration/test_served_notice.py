"""A holding engine (what verl's rollout side runs) hands a version to its readers only once
the daemon made it the served version, its READY written to the journal, and never a version
whose sync failed. A real daemon, a torch engine, a labelling engine in its own process (so
the sync has a commit phase: `commit`, then `committed`, before READY) and a holding engine
in this process; the order is read from the daemon's own journal."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engines.holding import HoldingReceiver
from examples.launch import Cluster
from examples.tiny import perturbed
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.helpers import FAST_DAEMON, running_daemon
from tests.integration.labelling_engine import start_labeller


def ready_rows(db: Path, version: int) -> list[tuple[int, str]]:
    """The daemon's journal: its transitions to READY with `version` (row id, sync id)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        q = "SELECT id, sync_id FROM transitions WHERE dst = 'READY' AND version = ? ORDER BY id"
        return [(int(i), str(s)) for i, s in con.execute(q, (version,))]
    finally:
        con.close()


@contextlib.contextmanager
def fleet(
    tmp_path: Path, model_dir: Path, mode: str, *daemon_args: str
) -> Iterator[tuple[Cluster, HoldingReceiver]]:
    with running_daemon(
        tmp_path / "c", model_dir, engines=1, min_engines=3, daemon_args=[*FAST_DAEMON, *daemon_args]
    ) as c:
        start_labeller(c, "labeller-1", mode)
        r = HoldingReceiver(model_dir, c.engine_addr, "holder-0", timeout=30.0)
        try:
            r.wait_registered()
            c.wait_engines(3)
            yield c, r
        finally:
            r.close()


def test_a_reader_gets_a_version_only_after_the_daemon_journaled_it_ready(
    tmp_path, tiny_model_dir, tiny_state
):
    """The labelling engine takes 0.5 s to answer `commit`: a holder that released the
    version at `commit` would hand it out before the daemon's READY row exists."""
    weights = dict(perturbed(tiny_state, 1))
    with fleet(tmp_path, tiny_model_dir, "slow=0.5") as (c, r), ThreadPoolExecutor(1) as pool:

        def reader() -> tuple[list[tuple[int, str]], dict[str, torch.Tensor]]:
            it = r.read(1)
            name, t = next(it)
            journal_then = ready_rows(c.state_db, 1)  # what the daemon had made durable by now
            got = {name: t.clone(), **{n: x.clone() for n, x in it}}
            return journal_then, got

        fut = pool.submit(reader)
        with c.client(timeout=60.0) as client:
            res = client.push(weights.items(), 1)
        journal_then, got = fut.result(timeout=30)
        assert journal_then == ready_rows(c.state_db, 1) and [s for _, s in journal_then] == [res.sync_id]
        assert got.keys() == weights.keys()
        for name, t in weights.items():
            assert torch.equal(got[name], t), name
        assert r.last_read == 1


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_an_engine_lost_or_late_in_the_commit_phase_leaves_readers_with_nothing(
    tmp_path, tiny_model_dir, tiny_state, mode
):
    """Every engine finalized version 1, then the labelling engine dies when told `commit`
    (kill) or never answers it (hang: --finalize-timeout): the sync fails, naming it, and
    no reader of the holding engine gets a tensor, neither one waiting nor one coming later."""
    weights = dict(perturbed(tiny_state, 1))
    with (
        fleet(tmp_path, tiny_model_dir, mode, "--finalize-timeout", "3") as (c, r),
        ThreadPoolExecutor(1) as pool,
    ):
        waiting = pool.submit(lambda: [name for name, _ in r.read(1)])
        with pytest.raises(WeightSyncError) as err, c.client(timeout=60.0) as client:
            client.push(weights.items(), 1)
        want = ErrorCode.TIMEOUT if mode == "hang" else ErrorCode.ENGINE_FAILED
        assert err.value.code == want, err.value
        assert (err.value.details or {}).get("engine_ids") == ["labeller-1"], err.value
        assert "labeller-1" in err.value.message
        with pytest.raises(WeightSyncError) as late:
            waiting.result(timeout=30)
        assert late.value.code == ErrorCode.ABORTED, late.value
        with pytest.raises(WeightSyncError) as again:
            next(r.read(1))
        assert again.value.code == ErrorCode.ABORTED, again.value
        assert r.engine.served is None and r.last_read is None
        assert ready_rows(c.state_db, 1) == []


def test_a_daemon_killed_after_journaling_ready_tells_the_holder_once_it_is_back(
    tmp_path, tiny_model_dir, tiny_state
):
    """The daemon dies right after READY is durable, before it told any engine: the reader
    waiting for version 1 gets it only from the restarted daemon, which finds the version
    served in its journal and tells the holder when it registers again."""
    weights = dict(perturbed(tiny_state, 1))
    with (
        running_daemon(
            tmp_path / "c",
            tiny_model_dir,
            engines=1,
            min_engines=2,
            daemon_args=[*FAST_DAEMON, "--failpoint", "kill_after_persisted=finalized"],
        ) as c,
        ThreadPoolExecutor(1) as pool,
    ):
        r = HoldingReceiver(tiny_model_dir, c.engine_addr, "holder-0", timeout=60.0, heartbeat_interval=0.5)
        try:
            r.wait_registered()
            c.wait_engines(2)
            first = c.daemon

            def reader() -> tuple[bool, dict[str, torch.Tensor]]:
                it = r.read(1)
                name, t = next(it)
                first_dead = first.popen.poll() is not None  # who released it: not the first daemon
                return first_dead, {name: t.clone(), **{n: x.clone() for n, x in it}}

            fut = pool.submit(reader)
            with pytest.raises(WeightSyncError), c.client(timeout=5.0, retries=0) as client:
                client.push(weights.items(), 1)
            first.popen.wait(15)
            assert first.popen.returncode == -9, first.log_tail()  # the failpoint, not a crash
            assert ready_rows(c.state_db, 1) != []  # READY was durable before it died
            c.daemon_args = list(FAST_DAEMON)
            c.start_daemon()
            first_dead, got = fut.result(timeout=60)
            assert first_dead
            assert got.keys() == weights.keys()
            for name, t in weights.items():
                assert torch.equal(got[name], t), name
        finally:
            r.close()
