"""A source of a sharded push is who began it: a second process that claims a running sync's
source index (same version, source count and plan, other weights) is refused, and the sync
fails for every source; it never commits with two trainers' bytes mixed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.daemon.config import child_env
from orchestrator.trainer.module import module_metas
from orchestrator.trainer.shard import plan_shards

from .helpers import finalized_syncs, running_daemon, wait_for

BUCKET = 16 * 1024  # small buckets: each source's part is several of them

# A second trainer process that pushes source SOURCE of WORLD with the weights of step SEED,
# planned exactly as the real sources are. argv: ADDR MODEL_DIR VERSION SOURCE WORLD SEED PARTIAL
# OUT. Writes OUT: {"state": ...} or {"code": ..., "message": ...}.
CLAIMANT = r"""
import json, sys
from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.errors import WeightSyncError
from orchestrator.trainer import TrainerClient
from orchestrator.trainer.module import module_metas
from orchestrator.trainer.shard import plan_shards
addr, model_dir, version, source, world, seed, partial, out = sys.argv[1:9]
model = load_model(model_dir)
plan = plan_shards(module_metas(model), int(world))
mine = [(n, t) for n, t in perturbed(model.state_dict(), int(seed)) if plan.mine(int(source), n)]
with TrainerClient(addr, timeout=30) as client:
    try:
        r = client.push(mine, int(version), source=(int(source), int(world)), plan=plan.key,
                        bucket_bytes=16 * 1024, partial=partial == "1")
        res = {"state": r.state}
    except WeightSyncError as err:
        res = {"code": err.code.value, "message": err.message}
open(out, "w").write(json.dumps(res))
"""


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_a_second_process_claiming_a_running_syncs_source_is_refused_and_nothing_mixes(
    tmp_path, tiny_model_dir, partial
):
    with running_daemon(tmp_path, tiny_model_dir, engines=2) as c:
        model = load_model(tiny_model_dir)
        plan = plan_shards(module_metas(model), 2)
        state = dict(perturbed(model.state_dict(), 1))
        parts = [[(n, t) for n, t in state.items() if plan.mine(k, n)] for k in range(2)]
        release = threading.Event()
        results: dict[int, Any] = {}

        def held(items: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            """Source 1's part, stopping after its first buckets until the claimant is done."""
            for i, item in enumerate(items):
                if i == len(items) // 2:
                    release.wait(60)
                yield item

        def run(k: int) -> None:
            tensors = held(parts[k]) if k == 1 else parts[k]
            with c.client(timeout=30.0) as client:
                try:
                    results[k] = client.push(
                        tensors, 1, source=(k, 2), plan=plan.key, bucket_bytes=BUCKET, partial=partial
                    )
                except WeightSyncError as err:
                    results[k] = err

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        try:
            # source 0 sent all and finished (its finish waits); source 1 sent some buckets
            def streaming() -> bool:
                sync = c.status().get("sync") or {}
                src = {x["source"]: x for x in sync.get("sources", [])}
                return bool(src) and src[0]["finished"] and src[1]["acked"] >= 1

            wait_for(streaming, 30, "source 0 finished and source 1 mid-stream")
            out = tmp_path / "claimant.json"
            args = [c.addr, str(tiny_model_dir), "1", "1", "2", "99", "1" if partial else "0", str(out)]
            p = subprocess.run(
                [sys.executable, "-c", CLAIMANT, *args],
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert p.returncode == 0, p.stderr[-2000:]
            claimant = json.loads(out.read_text())
        finally:
            release.set()
            for t in threads:
                t.join(60)
        # the claimant is refused, naming the source and the mistake
        assert claimant.get("code") == "SOURCE_CONFLICT", claimant
        assert (
            "source 1 of sync" in claimant["message"]
            and "two processes push as source 1" in claimant["message"]
        )
        # every real source is told the same, at once (the opener is not left waiting)
        for k in range(2):
            err = results[k]
            assert isinstance(err, WeightSyncError) and err.code is ErrorCode.SOURCE_CONFLICT, (k, err)
            assert "two processes push as source 1" in err.message, err.message
        st = c.status()
        assert st["last_sync"]["code"] == "SOURCE_CONFLICT" and st["last_sync"]["status"] == "FAILED"
        assert st["state"] != "READY" or st["version"] != 1  # version 1 was never served
        for proc in c.procs:
            if proc.name.startswith("engine"):
                assert finalized_syncs(proc) == []  # no engine ran its post-load step for it
        # the real sources push again: READY, holding exactly their bytes
        again: dict[int, Any] = {}

        def rerun(k: int) -> None:
            with c.client(timeout=30.0) as client:
                again[k] = client.push(parts[k], 2, source=(k, 2), plan=plan.key, bucket_bytes=BUCKET)

        threads = [threading.Thread(target=rerun, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert {r.state for r in again.values()} == {"READY"}, again
        assert {r.digest for r in again.values()} == {digest(list(state.items()))}


@pytest.mark.parametrize("mistake", ["version", "world"])
def test_sharded_ranks_that_disagree_both_hear_what_disagreed_at_once(tmp_path, tiny_model_dir, mistake):
    """Two ranks push with different versions (or world sizes): both fail within seconds
    naming the mismatch, instead of one waiting for --sync-timeout (300 s here)."""
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c:
        model = load_model(tiny_model_dir)
        w = list(perturbed(model.state_dict(), 1))
        if mistake == "version":
            jobs = [(w[0::2], 1, (0, 2)), (w[1::2], 2, (1, 2))]
        else:
            jobs = [(w[0::2], 1, (0, 2)), (w[1::3], 1, (1, 3))]
        results: dict[int, Any] = {}
        seconds: dict[int, float] = {}

        def run(k: int) -> None:
            part, version, source = jobs[k]
            t0 = time.monotonic()
            with c.client(timeout=30.0) as client:
                try:
                    results[k] = client.push(part, version, source=source, bucket_bytes=BUCKET)
                except WeightSyncError as err:
                    results[k] = err
            seconds[k] = time.monotonic() - t0

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        word = "began version" if mistake == "version" else "sources"
        for k in range(2):
            err = results[k]
            assert isinstance(err, WeightSyncError) and err.code is ErrorCode.SOURCE_CONFLICT, (k, err)
            assert word in err.message and seconds[k] < 20, (k, seconds[k], err.message)
        print({k: (round(seconds[k], 2), str(results[k])) for k in range(2)})
        assert c.status()["last_sync"]["code"] == "SOURCE_CONFLICT"
