"""Pushes cut into slices (issue: slices, not copies): a real daemon, real torch engine
subprocesses holding 2 tensor-parallel ranks each (`--tp 2`), the real client. Each rank
is handed only its slices, and its digest over them is checked by the daemon."""

from __future__ import annotations

import contextlib

import pytest

from engines.torch_engine import greedy, load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.cuts import cut
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import ParamSpec, Probe
from messages.slices import WHOLE, llama_tp_layout, rank_bytes

from .helpers import running_daemon, small_step, wait_for

PROMPTS = [(1, 17, 42, 99), (1, 250, 3)]


def _probes(model_dir, weights):
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return [Probe(p, 6, greedy(m, p, 6)) for p in PROMPTS]


def _per_rank(weights, tp):
    spec = {n: ParamSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights.items()}
    return rank_bytes(llama_tp_layout({n: p.shape for n, p in spec.items()}, tp), spec)


def _cut_bytes(weights, tp):
    """What a push cut for `tp` ranks sends: each distinct box once, the rest whole."""
    layout = llama_tp_layout({n: tuple(t.shape) for n, t in weights.items()}, tp)
    total = 0
    for n, t in weights.items():
        parts = {r[n] for r in layout if n in r}
        if WHOLE in parts:
            total += t.nbytes
        else:
            total += sum(cut(t, box).nbytes for box in parts)
    return total


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_each_rank_is_sent_its_slices_and_the_fleet_serves_the_trainers_model(
    tmp_path, tiny_model_dir, tiny_state, transport
):
    from .helpers import FAST_DAEMON
    from .test_metrics import scrape, until, value

    whole = sum(t.numel() * t.element_size() for t in tiny_state.values())
    want = _per_rank(tiny_state, 2)
    daemon = [*FAST_DAEMON, "--metrics-bind", "127.0.0.1:0"]
    with (
        running_daemon(tmp_path, tiny_model_dir, engine_args=["--tp", "2"], daemon_args=daemon) as cluster,
        cluster.client() as client,
    ):
        for v in (1, 2):
            weights = dict(perturbed(tiny_state, v))
            probes = _probes(tiny_model_dir, weights)
            r = client.push(weights.items(), v, bucket_bytes=64 * 1024, probes=probes, transport=transport)
            assert r.state == "READY" and r.digest == digest(weights.items())
            assert r.bytes < whole * 1.05  # each distinct slice sent once: about the model, not tp copies
            for e in r.engines:
                assert [tuple(p) for p in e["probes"]] == [p.expected for p in probes]
            st = client.status()
            for e in st["engines"]:
                got = e["slices"]["received"]
                # each rank was handed exactly its part: half the split tensors + the replicated
                assert got == want, (e["engine_id"], got, want)
                assert max(got) <= 0.6 * whole
                assert e["digest"] == r.digest and e["finalize_count"] == v
        # in the status table (MB per rank, of the last sync)
        from .helpers import ws

        table = ws("status", "--addr", cluster.addr).stdout
        assert "slices MB" in table and "/".join(f"{n / 1e6:.1f}" for n in want) in table, table
        # and in the metrics, per engine and rank
        addr = client.status()["daemon"]["metrics_addr"]
        m = until(lambda: (mm := scrape(addr)) and value(mm, "weightsync_served_version") == 2 and mm)
        for eid in ("engine-0", "engine-1"):
            got = [
                value(m, "weightsync_engine_rank_bytes_received", engine_id=eid, rank=str(r)) for r in (0, 1)
            ]
            assert got == want, (eid, got)


@contextlib.contextmanager
def _rank_1_misreported():
    """The client's finish claims another digest for rank 1 (every layout) while inside."""
    from messages.checksums import add_digests
    from orchestrator.trainer import client as client_mod

    real = client_mod.Cuts.rank_digests

    def lying(self, digester):
        return {k: (v[0], add_digests([v[1], "1"]), *v[2:]) for k, v in real(self, digester).items()}

    client_mod.Cuts.rank_digests = lying
    try:
        yield
    finally:
        client_mod.Cuts.rank_digests = real


def test_a_rank_holding_other_bytes_than_its_sender_computed_fails_the_sync(
    tmp_path, tiny_model_dir, tiny_state
):
    """The per-rank check can fail: a push whose finish claims other rank digests than
    the engines computed is refused, naming the engine and the rank, and nothing is served."""
    with (
        running_daemon(tmp_path, tiny_model_dir, engines=1, engine_args=["--tp", "2"]) as cluster,
        cluster.client() as client,
    ):
        with _rank_1_misreported(), pytest.raises(WeightSyncError) as err:
            client.push(dict(perturbed(tiny_state, 1)).items(), 1, bucket_bytes=64 * 1024)
        assert err.value.code is ErrorCode.ENGINE_FAILED
        assert "rank 1" in err.value.message and "engine-0" in err.value.message
        st = client.status()
        assert st["version"] is None or st["version"] != 1
        # the trainer retries with the truth: committed
        r = client.push(dict(perturbed(tiny_state, 2)).items(), 2, bucket_bytes=64 * 1024)
        assert r.state == "READY"


def test_a_failed_sliced_sync_rolls_the_fleet_back_by_slices_and_a_new_engine_catches_up(
    tmp_path, tiny_model_dir, tiny_state
):
    """A sync whose rank 1 does not hold what its sender computed fails; the daemon rolls
    both engines back to the served version from its spool, which holds that version's
    boxes; a third engine of the same layout, started later, catches up from it."""
    want = _per_rank(tiny_state, 2)
    daemon = ["--engine-timeout", "10", "--spool", str(tmp_path / "spool"), "--min-engines", "1"]
    with (
        running_daemon(tmp_path, tiny_model_dir, engine_args=["--tp", "2"], daemon_args=daemon) as cluster,
        cluster.client() as client,
    ):
        v1 = dict(perturbed(tiny_state, 1))
        r1 = client.push(v1.items(), 1, bucket_bytes=64 * 1024)
        assert r1.state == "READY"
        with _rank_1_misreported(), pytest.raises(WeightSyncError) as err:
            client.push(dict(perturbed(tiny_state, 2)).items(), 2, bucket_bytes=64 * 1024)
        assert err.value.code is ErrorCode.ENGINE_FAILED and "rank 1" in err.value.message

        def rolled_back():
            st = client.status()
            engines = st["engines"]
            ok = st["state"] == "READY" and all(
                e["state"] == "READY" and e["version"] == 1 and e["digest"] == r1.digest for e in engines
            )
            return st if ok and len(engines) == 2 else None

        from .helpers import wait_for

        st = wait_for(rolled_back, 120, "both engines rolled back to version 1")
        for e in st["engines"]:
            assert e["slices"]["received"] == want  # the rollback replayed each rank its slices
        cluster.start_engine("engine-2")

        def caught_up():
            st = client.status()
            e2 = [e for e in st["engines"] if e["engine_id"] == "engine-2"]
            return e2[0] if e2 and e2[0]["state"] == "READY" and e2[0]["version"] == 1 else None

        e2 = wait_for(caught_up, 120, "engine-2 caught up to version 1")
        assert e2["digest"] == r1.digest and e2["slices"]["received"] == want
        r3 = client.push(dict(perturbed(tiny_state, 3)).items(), 3, bucket_bytes=64 * 1024)
        assert r3.state == "READY" and len(r3.engines) == 3


def test_a_delta_push_by_slices_patches_each_ranks_box_and_a_new_engine_replays_it(
    tmp_path, tiny_model_dir, tiny_state
):
    """A delta push to engines of two ranks patches each rank's box against the box that
    rank holds: far fewer bytes than the dense cut, READY with every rank's digest checked
    and the version's digest the whole model's. A delta whose rank 1 holds other bytes
    than its sender computed fails and both engines are rolled back to the last delta
    version (the spool replays its boxes, then the box patches); a third engine of the
    same layout, started later, catches up the same way, and the next delta reaches all."""
    daemon = ["--engine-timeout", "10", "--spool", str(tmp_path / "spool"), "--min-engines", "1"]
    engine = ["--tp", "2", "--delta-base"]
    with (
        running_daemon(tmp_path, tiny_model_dir, engine_args=engine, daemon_args=daemon) as cluster,
        cluster.client() as client,
    ):
        v1 = dict(perturbed(tiny_state, 1))
        r1 = client.push(v1.items(), 1, bucket_bytes=64 * 1024, delta=True)  # no copy yet: dense, cut
        assert r1.state == "READY" and r1.detail["delta"]["chose"] == "dense"
        v2 = small_step(v1, 2, tensors=6)
        r2 = client.push(v2.items(), 2, bucket_bytes=64 * 1024, delta=True)
        assert r2.state == "READY" and r2.digest == digest(v2.items()), r2.detail["delta"]
        d = r2.detail["delta"]
        assert d["chose"] == "delta" and d["tensors"].get("sparse", 0) > 0, d
        # each sliced tensor went as its boxes: the dense equivalent is the cut push's bytes
        assert d["dense_bytes"] == _cut_bytes(tiny_state, 2)
        assert d["bytes"] < d["dense_bytes"] / 50, d
        assert {e["digest"] for e in client.status()["engines"]} == {r2.digest}

        with _rank_1_misreported(), pytest.raises(WeightSyncError) as err:
            client.push(small_step(v2, 3, tensors=6).items(), 3, bucket_bytes=64 * 1024, delta=True)
        assert err.value.code is ErrorCode.ENGINE_FAILED and "rank 1" in err.value.message

        def at_v2(n):
            def check():
                st = client.status()
                es = st["engines"]
                ok = st["state"] == "READY" and len(es) == n
                return (
                    st if ok and all(e["state"] == "READY" and e["digest"] == r2.digest for e in es) else None
                )

            return check

        wait_for(at_v2(2), 120, "both engines rolled back to version 2 (boxes, then box patches)")
        cluster.start_engine("engine-2")
        wait_for(at_v2(3), 120, "engine-2 caught up to version 2 from the spool")
        v4 = small_step(v2, 4, tensors=6)
        r4 = client.push(
            v4.items(), 4, bucket_bytes=64 * 1024, delta=True, probes=_probes(tiny_model_dir, v4)
        )
        assert r4.state == "READY" and len(r4.engines) == 3 and r4.detail["delta"]["chose"] == "delta"
        assert r4.digest == digest(v4.items())


def test_two_sources_into_two_rank_engines_over_the_collective(tmp_path, tiny_model_dir, tiny_state):
    """A sharded push of two sources over the collective to two engines of two ranks each:
    each source cuts its own tensors, the daemon adds the sources' rank digests up, and
    every rank ends up with exactly its slices."""
    from .test_sharded_push import _sources

    want = _per_rank(tiny_state, 2)
    v1 = dict(perturbed(tiny_state, 1))
    items = sorted(v1.items())
    parts = [items[0::2], items[1::2]]
    with running_daemon(tmp_path, tiny_model_dir, engine_args=["--tp", "2"]) as cluster:
        results = _sources(cluster.client, parts, 1, transport="collective", bucket_bytes=64 * 1024)
        for k in (0, 1):
            r = results.get(k)
            assert not isinstance(r, Exception) and r is not None, r
            assert r.state == "READY" and r.digest == digest(v1.items())
            assert r.detail["transport"] == "collective", r.detail["transport"]
        with cluster.client() as client:
            st = client.status()
        for e in st["engines"]:
            assert (e["version"], e["digest"]) == (1, digest(v1.items()))
            assert e["slices"]["received"] == want


def test_a_rank_failing_mid_sync_rolls_the_whole_fleet_back(tmp_path, tiny_model_dir, tiny_state):
    """engine-1's ranks fail while loading the third sliced bucket of version 2, with part
    of that bucket written (`--failpoint fail_slices_at`): the sync fails naming engine-1,
    nothing is served of version 2, and both engines are rolled back to version 1 by
    slices; the next push commits on both."""
    from messages.buckets import Digester, iter_buckets
    from messages.cuts import Cuts
    from messages.slices import layout_key

    from .helpers import wait_for

    want = _per_rank(tiny_state, 2)
    spec_shapes = {n: tuple(t.shape) for n, t in tiny_state.items()}
    layout = llama_tp_layout(spec_shapes, 2)
    v1 = dict(perturbed(tiny_state, 1))
    # the sliced buckets engine-1 loads catching up to version 1 (the spool replays them)
    boxed = sum(
        any(m.box is not None for m in b.tensors)
        for b in iter_buckets(Cuts({layout_key(layout): layout}).items(v1.items(), Digester()), 64 * 1024)
    )
    daemon = ["--engine-timeout", "10", "--spool", str(tmp_path / "spool"), "--min-engines", "1"]
    with (
        running_daemon(
            tmp_path, tiny_model_dir, engines=1, engine_args=["--tp", "2"], daemon_args=daemon
        ) as c,
        c.client() as client,
    ):
        r1 = client.push(v1.items(), 1, bucket_bytes=64 * 1024)
        assert r1.state == "READY"
        c.start_engine("engine-1", extra=["--failpoint", f"fail_slices_at={boxed + 3}"])

        def serving(version, digest_):
            def check():
                st = client.status()
                es = st["engines"]
                ok = st["state"] == "READY" and len(es) == 2
                return (
                    st
                    if ok
                    and all(
                        (e["state"], e["version"], e["digest"]) == ("READY", version, digest_) for e in es
                    )
                    else None
                )

            return check

        wait_for(serving(1, r1.digest), 120, "engine-1 caught up to version 1")
        with pytest.raises(WeightSyncError) as err:
            client.push(dict(perturbed(tiny_state, 2)).items(), 2, bucket_bytes=64 * 1024)
        assert err.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in err.value.message, err.value
        assert "fail_slices_at" in err.value.message, err.value  # the injected failure, not another
        st = wait_for(serving(1, r1.digest), 120, "both engines rolled back to version 1")
        assert all(e["slices"]["received"] == want for e in st["engines"])
        r3 = client.push(dict(perturbed(tiny_state, 3)).items(), 3, bucket_bytes=64 * 1024)
        assert r3.state == "READY" and sorted(e["engine_id"] for e in r3.engines) == ["engine-0", "engine-1"]


def test_engines_of_other_layouts_catch_up_from_a_spool_of_boxes_and_take_part_after(
    tmp_path, tiny_model_dir, tiny_state
):
    """The spool keeps the boxes a push to engines of two ranks was cut into. A later
    engine that takes whole tensors, and one of four ranks (another partition), catch up
    from it: the daemon says which layouts the boxes were cut for (`Load.cut_for`), and
    each assembles whole tensors from them (engines/tiles.py), so both serve the version's
    digest. A push that breaks half-way is rolled back from the same spool, each engine
    assembling or taking its boxes again; the next push goes whole (an engine of the fleet
    declared no ranks now) and commits on all three."""
    daemon = ["--spool", str(tmp_path / "spool"), "--min-engines", "1"]
    with (
        running_daemon(
            tmp_path, tiny_model_dir, engines=1, engine_args=["--tp", "2"], daemon_args=daemon
        ) as cluster,
        cluster.client() as client,
    ):
        v1 = dict(perturbed(tiny_state, 1))
        r1 = client.push(v1.items(), 1, bucket_bytes=64 * 1024)
        assert r1.state == "READY" and r1.digest == digest(v1.items())
        cluster.start_engine("whole", ["--tp", "1"])
        cluster.start_engine("four", ["--tp", "4"])

        def caught_up():
            es = {e["engine_id"]: e for e in client.status()["engines"]}
            ok = {"whole", "four"} <= set(es) and all(
                es[k]["state"] == "READY" and es[k]["version"] == 1 for k in ("whole", "four")
            )
            return es if ok else None

        es = wait_for(
            caught_up, 120, "the whole engine and the tp-4 engine caught up from the spool of boxes"
        )
        assert es["whole"]["digest"] == es["four"]["digest"] == r1.digest

        def broken():
            items = list(perturbed(tiny_state, 2))
            yield from items[: len(items) // 2]
            raise RuntimeError("trainer step crashed")

        with pytest.raises(RuntimeError):
            client.push(broken(), 2, bucket_bytes=16 * 1024)

        def rolled_back():
            st = client.status()
            es = st["engines"]
            ok = st["state"] == "READY" and len(es) == 3 and st["last_sync"]["kind"] == "rollback"
            return st if ok and all(e["state"] == "READY" and e["digest"] == r1.digest for e in es) else None

        st = wait_for(rolled_back, 120, "the three engines rolled back to version 1 from the spool of boxes")
        # the rollback itself brought all three back (no engine failed it to catch up later)
        assert st["last_sync"]["status"] == "ROLLED_BACK", st["last_sync"]
        assert sorted(st["last_sync"]["engine_ids"]) == ["engine-0", "four", "whole"]
        v2 = dict(perturbed(tiny_state, 2))
        r2 = client.push(v2.items(), 2, bucket_bytes=64 * 1024, probes=_probes(tiny_model_dir, v2))
        assert r2.state == "READY" and len(r2.engines) == 3 and r2.digest == digest(v2.items())
