"""Delta sync end to end: a real daemon with a spool, torch engines keeping a base copy
(`--delta-base`), the real client's `push(delta=True)`."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from engines.torch_engine import greedy, load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Probe

from .helpers import finalized_syncs, push_lying_delta, running_daemon, small_step, ws

PROMPTS = [(1, 17, 42, 99), (1, 250, 3)]
_versions = itertools.count(1)


def probes_for(model_dir, weights):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return [Probe(p, 6, greedy(m, p, 6)) for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("delta")
    with running_daemon(
        work,
        tiny_model_dir,
        daemon_args=["--engine-timeout", "3", "--spool", str(work / "spool")],
        engine_args=["--delta-base"],
    ) as c:
        yield c


def served(cluster):
    st = cluster.status()
    return st["version"], st


def wait_ready(client, version, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status()
        live = [e for e in st["engines"] if e["state"] != "LOST"]
        if (
            st["state"] == "READY"
            and st["version"] == version
            and all(e["state"] == "READY" and e["version"] == version for e in live)
        ):
            return st
        time.sleep(0.2)
    raise AssertionError(f"not READY at {version}: {client.status()}")


def fresh_version(cluster):
    v, _ = served(cluster)
    return max(next(_versions), (v or 0) + 1)


def test_a_delta_push_serves_the_digest_and_generation_of_the_same_weights(
    cluster, tiny_model_dir, tiny_state
):
    with cluster.client(timeout=20.0) as client:
        v = fresh_version(cluster)
        w = dict(perturbed(tiny_state, v))
        first = client.push(list(w.items()), v, delta=True)  # no copy yet: dense, and kept
        assert first.detail["delta"]["base"] is None and first.detail["delta"]["tensors"] == {"dense": len(w)}
        for mode, kind in (("auto", "sparse"), ("xor", "xor")):
            v2 = v + 1
            w2 = small_step(w, v2)
            probes = probes_for(tiny_model_dir, w2)
            r = client.push(list(w2.items()), v2, delta=True, delta_mode=mode, probes=probes)
            d = r.detail["delta"]
            assert r.state == "READY" and d["base"] == v
            assert d["tensors"] == {kind: 3, "same": len(w) - 3}
            assert d["bytes"] <= r.bytes < d["dense_bytes"] / 50  # 150 changed values (+ alignment)
            assert r.digest == digest(w2.items())  # what a dense push of these weights yields
            for e in r.engines:
                assert e["digest"] == r.digest
                assert [tuple(p) for p in e["probes"]] == [p.expected for p in probes]
            v, w = v2, w2


def test_a_corrupted_patch_fails_the_sync_with_nothing_finalized(cluster, tiny_state):
    with cluster.client(timeout=20.0) as client:
        v = fresh_version(cluster)
        w = dict(perturbed(tiny_state, v))
        client.push(list(w.items()), v, delta=True)
        before = {e["engine_id"]: e for e in client.status()["engines"]}
        err = push_lying_delta(client, w, v, seed=7, at=0, by=1.0)
        assert err.code is ErrorCode.CHECKSUM_MISMATCH
        assert "rebuilt a tensor that is not the trainer's" in err.message
        st = wait_ready(client, v)
        for e in st["engines"]:  # still at v, digest unchanged
            assert (e["version"], e["digest"]) == (v, before[e["engine_id"]]["digest"])
        assert st["last_sync"]["status"] != "READY"
        # and v + 1's post-load step ran on no engine (a rollback's may have: another sync)
        engines = [p for p in cluster.procs if p.name.startswith("engine-")]
        assert err.sync_id and all(err.sync_id not in finalized_syncs(p) for p in engines)
        assert all(finalized_syncs(p) for p in engines)  # the log is read: v's finalize is there


def test_a_delta_against_a_stale_base_is_refused_then_pushed_dense(cluster, tiny_state):
    with cluster.client(timeout=20.0) as a, cluster.client(timeout=20.0) as b:
        v = fresh_version(cluster)
        a.push(list(dict(perturbed(tiny_state, v)).items()), v, delta=True)
        b.push(list(dict(perturbed(tiny_state, v + 1)).items()), v + 1)  # a's copy is now stale
        with pytest.raises(WeightSyncError) as ei:
            a.begin(v + 2, base=v)
        assert ei.value.code is ErrorCode.STALE_BASE
        assert f"the delta applies to version {v}, the fleet serves {v + 1}" in ei.value.message
        w = small_step(dict(perturbed(tiny_state, v + 1)), 3)
        r = a.push(list(w.items()), v + 2, delta=True)  # refused, then dense
        assert r.state == "READY" and r.detail["delta"]["base"] is None
        assert r.digest == digest(w.items())
        r = a.push(list(small_step(w, 4).items()), v + 3, delta=True)  # the dense push is the new base
        assert r.detail["delta"]["base"] == v + 2 and "sparse" in r.detail["delta"]["tensors"]


def test_the_delta_chooser_measures_each_push_under_the_transport_the_daemon_chose(cluster, tiny_state):
    """A push asking "auto" is measured under the transport the daemon answered its begin
    with, dense and delta alike, never under "auto"."""
    with cluster.client(timeout=20.0) as client:
        v = fresh_version(cluster)
        w = dict(perturbed(tiny_state, v))
        first = client.push(list(w.items()), v, delta=True)  # dense: no copy yet
        r = client.push(list(small_step(w, v + 1).items()), v + 1, delta=True)
        chose = first.detail["transport"]
        assert r.detail["delta"]["base"] == v and r.detail["transport"] == chose != "auto"
        assert set(client.delta_chooser.paces) == {chose} and client.delta_chooser.answered == {"auto": chose}
        pace = client.delta_chooser.paces[chose]
        assert pace.dense is not None and pace.delta is not None


class Breaks(list):
    """A list of tensors whose iteration fails half-way (a trainer crash mid-push)."""

    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == len(self) // 2:
                raise RuntimeError("trainer step crashed")
            yield item


def test_a_delta_sync_failing_half_way_is_rolled_back_to_the_exact_previous_version(cluster, tiny_state):
    with cluster.client(timeout=20.0) as client:
        v = fresh_version(cluster)
        w = dict(perturbed(tiny_state, v))
        client.push(list(w.items()), v, delta=True)
        w1 = small_step(w, 11)
        client.push(list(w1.items()), v + 1, delta=True)  # the spool: v dense + one delta
        w2 = small_step(w1, 12, tensors=8)
        with pytest.raises(RuntimeError, match="crashed"):
            client.push(Breaks(w2.items()), v + 2, delta=True, bucket_bytes=64 * 1024)
        st = wait_ready(client, v + 1)
        assert {e["digest"] for e in st["engines"]} == {digest(w1.items())}
        # the trainer's copy was put back exactly: the next delta rebuilds right everywhere
        w3 = small_step(w1, 13)
        r = client.push(list(w3.items()), v + 2, delta=True)
        assert r.detail["delta"]["base"] == v + 1 and r.digest == digest(w3.items())


def test_an_engine_rejoining_after_three_delta_versions_serves_the_right_digest(cluster, tiny_state):
    with cluster.client(timeout=20.0) as client:
        v = fresh_version(cluster)
        w = dict(perturbed(tiny_state, v))
        client.push(list(w.items()), v, delta=True)
        for k in (1, 2, 3):
            w = small_step(w, 20 + k)
            r = client.push(list(w.items()), v + k, delta=True)
            assert r.detail["delta"]["base"] == v + k - 1
        assert client.status()["spool"]["chain"] >= 3
        [p] = [p for p in cluster.procs if p.name == "engine-1"]
        p.stop()
        pid = cluster.start_engine("engine-1").popen.pid
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the new process registered and caught up
            rejoined = {e["engine_id"]: e for e in client.status()["engines"]}["engine-1"]
            if rejoined["pid"] == pid and rejoined["state"] == "READY":
                break
            time.sleep(0.2)
        assert (rejoined["pid"], rejoined["version"], rejoined["digest"]) == (pid, v + 3, digest(w.items()))
        # its base came from the replay: the next delta rebuilds there too
        w = small_step(w, 30)
        r = client.push(list(w.items()), v + 4, delta=True)
        assert r.detail["delta"]["base"] == v + 3 and {e["digest"] for e in r.engines} == {digest(w.items())}


def test_an_engine_without_a_base_copy_is_named_and_the_push_goes_dense(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir, engines=1) as c, c.client(timeout=20.0) as client:
        w = dict(perturbed(tiny_state, 1))
        client.push(list(w.items()), 1, delta=True)
        with pytest.raises(WeightSyncError) as ei:
            client.begin(2, base=1)
        assert ei.value.code is ErrorCode.STALE_BASE and "engine-0 keeps no base copy" in ei.value.message
        w = small_step(w, 2)
        r = client.push(list(w.items()), 2, delta=True)
        assert r.state == "READY" and r.detail["delta"]["base"] is None and r.digest == digest(w.items())


def test_the_cli_pushes_a_checkpoint_as_a_delta_against_the_one_the_fleet_serves(
    cluster, tmp_path, tiny_state
):
    from safetensors.torch import save_file

    v = fresh_version(cluster)
    w = dict(perturbed(tiny_state, v))
    w2 = small_step(w, 40)
    for name, weights in (("old", w), ("new", w2)):
        (tmp_path / name).mkdir()
        save_file({k: t.contiguous() for k, t in weights.items()}, str(tmp_path / name / "model.safetensors"))

    def push(ckpt: str, version: int, *extra: str) -> dict:
        r = ws(
            "push", str(tmp_path / ckpt), "--version", str(version), "--addr", cluster.addr, "--json", *extra
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    push("old", v)
    out = push("new", v + 1, "--delta-from", str(tmp_path / "old"))
    assert out["delta"]["base"] == v and out["delta"]["tensors"]["sparse"] == 3
    assert out["bytes"] < out["delta"]["dense_bytes"] / 50 and out["digest"] == digest(w2.items())
    # against a checkpoint the fleet does not serve: the engines refuse it, the push goes dense
    out = push("old", v + 2, "--delta-from", str(tmp_path / "old"))
    assert out["delta"]["base"] is None and out["digest"] == digest(w.items())


def test_an_engine_without_a_base_copy_reaches_a_delta_version_by_catch_up_and_rollback(
    tmp_path, tiny_model_dir, tiny_state
):
    """A fleet with base copies serves a delta version (the spool: v1 dense + one delta);
    an engine started WITHOUT --delta-base catches up to it (the replay says `hold`, so it
    keeps what the replay loads until the patches are rebuilt) with the fleet's digest;
    then a dense push that fails mid-way is rolled back on all three, READY. (Before, the
    new engine stayed STALE with STALE_BASE, and the failed rollback left the whole fleet
    STALE, IDLE-dirty.)"""
    args = ["--engine-timeout", "5", "--spool", str(tmp_path / "spool"), "--min-engines", "1"]
    with running_daemon(tmp_path / "d", tiny_model_dir, daemon_args=args, engine_args=["--delta-base"]) as c:
        with c.client(timeout=30.0) as client:
            w1 = dict(perturbed(tiny_state, 1))
            client.push(list(w1.items()), 1, delta=True)
            w2 = small_step(w1, 5)
            r = client.push(list(w2.items()), 2, delta=True)
            assert r.detail["delta"]["base"] == 1 and client.status()["spool"]["chain"] == 1
            pid = c.start_engine("engine-2", ["--no-delta-base"]).popen.pid
            c.wait_engines(3)
            st = wait_ready(client, 2)
            new = {e["engine_id"]: e for e in st["engines"]}["engine-2"]
            assert (new["pid"], new["delta"], new["digest"]) == (pid, False, digest(w2.items()))
            assert new["finalize_count"] == 1  # finalized once, by its catch-up
            with pytest.raises(RuntimeError, match="crashed"):
                client.push(Breaks(dict(perturbed(tiny_state, 3)).items()), 3, bucket_bytes=64 * 1024)
            st = wait_ready(client, 2)
            assert len(st["engines"]) == 3 and not st["dirty"]
            assert {e["digest"] for e in st["engines"]} == {digest(w2.items())}
            new = {e["engine_id"]: e for e in st["engines"]}["engine-2"]
            assert new["finalize_count"] == 2  # the catch-up, then the rollback
