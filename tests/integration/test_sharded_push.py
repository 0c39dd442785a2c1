"""A sharded push: several trainer processes each push a disjoint part of one version into
one sync (one sync_id, one digest, one finalize per engine), and any source's failure fails
it for all, with the fleet rolled back."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.daemon.config import child_env
from orchestrator.trainer.module import module_metas, module_tensors
from orchestrator.trainer.shard import plan_shards
from tests.integration.sharded_rank import step

from .helpers import FAST_DAEMON, finalized_syncs, running_daemon, wait_for

RANK = str(Path(__file__).with_name("sharded_rank.py"))
ROOT = str(Path(__file__).resolve().parents[2])


def ranks_out(out_dir: Path, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def test_four_fsdp2_ranks_push_one_version_inline_by_shm_and_by_the_collective(tmp_path, tiny_model_dir):
    """torchrun, 4 gloo ranks, FSDP2: every rank sends only its planned part; each version is
    READY with the whole model's digest and the unsharded model's greedy outputs (canaries);
    over the collective each rank broadcasts from a group of its own, no byte through the
    daemon."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with running_daemon(tmp_path, tiny_model_dir, engines=2) as c:
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
            + [RANK, "fsdp", str(tiny_model_dir), c.addr, str(out_dir)],
            capture_output=True,
            text=True,
            timeout=400,
            env=child_env({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}),
            cwd=ROOT,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        st = c.status()
        finals = {p.name: finalized_syncs(p) for p in c.procs if p.name.startswith("engine")}
    outs = ranks_out(out_dir, 4)
    model = load_model(tiny_model_dir)
    step(model, 41)
    want1 = digest(module_tensors(model))
    step(model, 42)
    want2 = digest(module_tensors(model))
    step(model, 43)
    want3 = digest(module_tensors(model))
    assert all(o["dtensor"] for o in outs)
    for version, want, transport in (("1", want1, "inline"), ("2", want2, "shm"), ("3", want3, "collective")):
        rs = [o[version] for o in outs]
        assert {r["state"] for r in rs} == {"READY"}
        assert len({r["sync_id"] for r in rs}) == 1  # one sync, named by the daemon for all
        assert {r["digest"] for r in rs} == {want}  # the version's digest, from the sources' parts
        assert {d for r in rs for d in r["engines"]} == {want}
        assert {r["transport"] for r in rs} == {transport}
        assert len({r["source_digest"] for r in rs}) == 4  # each source sent its own part
        plan = plan_shards(module_metas(model), 4)
        assert sorted(r["bytes"] for r in rs) == sorted(plan.loads)
    assert [o["3"]["plans_computed"] for o in outs] == [1, 1, 1, 1]  # computed once, replayed
    assert (st["state"], st["version"], st["digest"]) == ("READY", 3, want3)
    # only version 1's inline frames passed through the daemon: no byte of the shm or the
    # collective version did
    assert st["daemon"]["bytes_received"] == sum(plan_shards(module_metas(model), 4).loads)
    syncs = {outs[0][v]["sync_id"] for v in ("1", "2", "3")}
    for name, ids in finals.items():  # each engine finalized each version exactly once
        assert sorted(ids) == sorted(syncs), (name, ids)


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_a_source_killed_mid_push_fails_the_sync_for_all_and_the_fleet_rolls_back(
    tmp_path, tiny_model_dir, transport
):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [*FAST_DAEMON, "--spool", str(tmp_path / "spool")]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, daemon_args=args) as c:
        state = load_model(tiny_model_dir).state_dict()
        w1 = dict(perturbed(state, 1))
        with c.client(timeout=30.0) as client:
            r1 = client.push(w1.items(), 1, bucket_bytes=64 * 1024)
        sid = uuid.uuid4().hex  # one sync_id on every rank (push_module(sharded=True) agrees on one)
        procs = [
            subprocess.Popen(
                [sys.executable, RANK, f"kill-{transport}", str(tiny_model_dir), c.addr, str(out_dir), sid],
                env=child_env({"PYTHONPATH": ROOT, "RANK": str(r), "WORLD_SIZE": "4"}),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(4)
        ]
        outs = [p.communicate(timeout=240) for p in procs]
        assert procs[2].returncode == -9
        assert [p.returncode for i, p in enumerate(procs) if i != 2] == [0, 0, 0], [
            o[1][-2000:] for o in outs
        ]
        st = wait_for(
            lambda: (s := c.status())["state"] == "READY" and s["last_sync"]["kind"] == "rollback" and s,
            60,
            "the fleet rolled back",
        )
    survivors = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1, 3)]
    # every other source was told the sync failed, naming source 2: its connection closed
    # (ABORTED after the grace), or over the collective an engine's receive from source 2's
    # group broke first (ENGINE_FAILED on source 2's bucket)
    named = {"ABORTED": "source(s) [2]", "ENGINE_FAILED": "on source 2's bucket"}
    for o in survivors:
        assert o["error"]["code"] in (("ABORTED",) if transport == "inline" else tuple(named)), o
        assert named[o["error"]["code"]] in o["error"]["message"], o
    assert (st["version"], st["digest"]) == (1, r1.digest)
    failed = st["last_sync"]["rolled_back_from"]
    assert named[failed["code"]] in failed["reason"]
    for e in st["engines"]:
        assert (e["state"], e["version"], e["digest"]) == ("READY", 1, digest(w1.items()))


def _sources(client_of, parts, version, **kw):
    """Push `parts[k]` from source k, each from its own thread and connection."""
    results: dict[int, object] = {}

    def run(k: int) -> None:
        with client_of() as client:
            try:
                results[k] = client.push(parts[k], version, source=(k, len(parts)), **kw)
            except WeightSyncError as err:
                results[k] = err

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.parametrize("fault", ["duplicate", "missing"])
def test_a_tensor_sent_twice_or_by_no_source_is_refused_before_any_finalize(tmp_path, tiny_model_dir, fault):
    with running_daemon(tmp_path, tiny_model_dir, engines=2) as c:
        w = list(perturbed(load_model(tiny_model_dir).state_dict(), 1))
        parts = [w[0::2], w[1::2]]
        if fault == "duplicate":
            parts[1] = [*parts[1], parts[0][-1]]  # source 1 also sends source 0's last tensor
        else:
            parts[1] = parts[1][:-1]  # nobody sends source 1's last tensor
        res = _sources(lambda: c.client(timeout=30.0), parts, 1, bucket_bytes=1 << 30)
        errs = [r for r in res.values() if isinstance(r, WeightSyncError)]
        assert len(errs) == 2, res  # both sources fail
        codes = {e.code for e in errs}
        want = ErrorCode.DUPLICATE_TENSOR if fault == "duplicate" else ErrorCode.INCOMPLETE_SYNC
        assert want in codes, errs
        st = c.status()
        assert st["last_sync"]["code"] == want.value
        for p in c.procs:
            if p.name.startswith("engine"):
                assert finalized_syncs(p) == []  # refused before any engine finalized
        # the trainer fixes its parts and pushes again: READY, with the whole model's digest
        res = _sources(lambda: c.client(timeout=30.0), [w[0::2], w[1::2]], 2, bucket_bytes=64 * 1024)
        assert {r.state for r in res.values()} == {"READY"}, res
        assert {r.digest for r in res.values()} == {digest(w)}


def test_a_source_that_never_begins_fails_the_sync_at_the_sync_timeout_named(tmp_path, tiny_model_dir):
    args = [*FAST_DAEMON, "--sync-timeout", "2"]
    with running_daemon(tmp_path, tiny_model_dir, engines=1, daemon_args=args) as c:
        w = list(perturbed(load_model(tiny_model_dir).state_dict(), 1))
        with c.client(timeout=30.0) as client, pytest.raises(WeightSyncError) as ei:
            client.push(w[0::3], 1, source=(0, 3), bucket_bytes=64 * 1024)
        assert ei.value.code is ErrorCode.TIMEOUT
        assert "source(s) [1, 2] of 3 never began" in ei.value.message
        st = c.status()
        assert st["last_sync"]["code"] == "TIMEOUT" and "[1, 2] of 3 never began" in st["last_sync"]["reason"]
        assert [x["begun"] for x in st["last_sync"]["sources"]] == [True, False, False]
        assert st["state"] == "IDLE" and st["dirty"]  # source 0's buckets reached the engine


def test_status_and_metrics_show_each_source_while_a_sharded_push_runs(tmp_path, tiny_model_dir):
    from tests.integration.test_metrics import scrape, value

    args = [*FAST_DAEMON, "--metrics-bind", "127.0.0.1:0"]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, daemon_args=args) as c:
        addr = c.status()["daemon"]["metrics_addr"]
        w = list(perturbed(load_model(tiny_model_dir).state_dict(), 1))
        parts = [w[0::2], w[1::2]]
        release = threading.Event()

        def held(k):  # source 1 holds back its last tensor until the test has looked
            for i, item in enumerate(parts[k]):
                if k == 1 and i == len(parts[k]) - 1:
                    release.wait(30)
                yield item

        res: dict[int, object] = {}

        def run(k):
            with c.client(timeout=30.0) as client:
                res[k] = client.push(held(k), 1, source=(k, 2), bucket_bytes=16 * 1024)

        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        try:
            st = wait_for(
                lambda: (s := c.status())["sync"] and s["sync"]["sources"][0]["finished"] and s,
                30,
                "source 0 finished, source 1 still sending",
            )
            src = st["sync"]["sources"]
            assert st["sync"]["source_count"] == 2 and [x["begun"] for x in src] == [True, True]
            assert not src[1]["finished"] and src[0]["bytes"] > 0 and src[1]["bytes"] > 0
            m = wait_for(  # the metrics' snapshot may trail the status by a refresh
                lambda: (
                    (mm := scrape(addr))
                    and value(mm, "weightsync_sync_sources") == 2
                    and value(mm, "weightsync_source_state", source="0", state="finished") == 1
                    and mm
                ),
                10,
                "the metrics show the running sharded push, source 0 finished",
            )
            assert value(m, "weightsync_source_state", source="0", state="finished") == 1
            assert value(m, "weightsync_source_state", source="1", state="sending") == 1
            assert value(m, "weightsync_source_bytes", source="1") == src[1]["bytes"]
        finally:
            release.set()
            for t in threads:
                t.join(60)
        assert {r.state for r in res.values()} == {"READY"}
        assert (
            value(
                wait_for(
                    lambda: (mm := scrape(addr)) and value(mm, "weightsync_sync_sources") == 0 and mm,
                    10,
                    "no sync",
                ),
                "weightsync_sync_sources",
            )
            == 0
        )
