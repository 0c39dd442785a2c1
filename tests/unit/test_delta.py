"""Delta patches, pure parts: encode/rebuild exactness, refusals with codes, the codec's
checks, the trainer's copy and its exact undo, the spool's base + deltas chain, and the
core's base check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.delta import BaseStore
from messages import codec, delta, schema
from messages.buckets import Patched, iter_buckets
from messages.checksums import LEGACY_DIGEST_SCHEME
from messages.errors import ErrorCode, MessageError, WeightSyncError
from messages.schema import Begin, Patch, Register, TensorMeta
from orchestrator.core import Core, Limits
from orchestrator.core import events as ev
from orchestrator.core.records import Spooled
from orchestrator.daemon.spool import Spool
from orchestrator.trainer.delta import DeltaBase

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.bool, torch.float8_e4m3fn]


def tensor(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype == torch.int8:
        return torch.randint(-100, 100, (n,), generator=g, dtype=torch.int8)
    return torch.randn(n, generator=g).to(dtype)


def changed(base, frac, seed):
    g = torch.Generator().manual_seed(seed)
    out = base.clone()
    k = int(out.numel() * frac)
    idx = torch.randperm(out.numel(), generator=g)[:k]
    ints = out.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[out.element_size()]).view(-1)
    ints[idx] ^= 1  # the lowest bit of each chosen element
    return out


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 20000),
    frac=st.sampled_from([0.0, 0.001, 0.05, 0.3, 0.9, 1.0]),
    mode=st.sampled_from(["auto", "sparse", "xor"]),
    seed=st.integers(0, 1000),
)
def test_a_patch_rebuilds_the_new_tensor_bit_for_bit(dtype, n, frac, mode, seed):
    base = tensor(dtype, n, seed)
    new = changed(base, frac, seed + 1)
    bp = delta.part("w", base)
    enc, new_part = delta.encode("w", new, base, lambda: bp, mode)
    if enc.patch is None:  # dense: only where no patch is smaller (its part: the packing's)
        assert enc.data is new and new_part is None
        return
    assert new_part == delta.part("w", new)
    assert enc.data.numel() < new.numel() * new.element_size() or enc.patch.kind == "same"
    meta = TensorMeta("w", schema_dtype(dtype), (n,), 0, int(enc.data.numel()), enc.patch)
    codec._check_tensors([meta], int(enc.data.numel()))  # what the codec checks on receipt
    out = delta.rebuild(meta, enc.data, base, bp)
    assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))


def schema_dtype(dtype):
    from messages.dtypes import dtype_name

    return dtype_name(dtype)


def _sparse_case():
    base = tensor(torch.bfloat16, 5000, 1)
    new = changed(base, 0.01, 2)
    bp = delta.part("w", base)
    enc, _ = delta.encode("w", new, base, lambda: bp)
    assert enc.patch is not None and enc.patch.kind == "sparse"
    meta = TensorMeta("w", "bfloat16", (5000,), 0, int(enc.data.numel()), enc.patch)
    return base, new, bp, enc, meta


def test_a_patch_on_another_base_is_stale_base_and_a_wrong_rebuild_is_a_checksum_mismatch():
    base, new, bp, enc, meta = _sparse_case()
    before = base.clone()  # taken before any rebuild: the base must come out of them unchanged
    other = changed(base, 0.001, 9)
    with pytest.raises(WeightSyncError) as ei:
        delta.rebuild(meta, enc.data, other, delta.part("w", other))
    assert ei.value.code is ErrorCode.STALE_BASE
    with pytest.raises(WeightSyncError) as ei:
        delta.rebuild(meta, enc.data, None, None)
    assert ei.value.code is ErrorCode.STALE_BASE
    bad = enc.data.clone()
    bad[-1] ^= 1  # a value byte: a different tensor comes out
    with pytest.raises(WeightSyncError) as ei:
        delta.rebuild(meta, bad, base, bp)
    assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH
    bad = enc.data.clone()
    bad[:4].view(torch.int32)[0] = 10**6  # an index past the end
    with pytest.raises(WeightSyncError) as ei:
        delta.rebuild(meta, bad, base, bp)
    assert ei.value.code is ErrorCode.BAD_MESSAGE
    assert torch.equal(base, before)  # the base is never written


def test_the_codec_refuses_a_patch_whose_size_does_not_follow_from_its_kind():
    _, _, _, enc, meta = _sparse_case()
    n = int(enc.data.numel())
    for bad in (
        TensorMeta("w", "bfloat16", (5000,), 0, n + 6, meta.patch),
        TensorMeta("w", "bfloat16", (5000,), 0, 2, Patch("same", meta.patch.base, meta.patch.result)),
        TensorMeta("w", "bfloat16", (5000,), 0, 10000, Patch("xor", meta.patch.base, meta.patch.result)),
        TensorMeta("w", "bfloat16", (5,), 0, 6 * 9, Patch("sparse", meta.patch.base, meta.patch.result, 9)),
    ):
        with pytest.raises(MessageError) as ei:
            codec._check_tensors([bad], 1 << 20)
        assert ei.value.code is ErrorCode.BAD_MESSAGE


def test_the_trainers_copy_is_put_back_exactly_or_dropped_when_a_push_fails():
    db = DeltaBase()
    w = {f"t{i}": tensor(torch.bfloat16, 3000, i) for i in range(4)}
    list(db.record(w.items()))
    db.commit(1)
    snapshot = {k: v.clone() for k, (v, _) in db._t.items()}
    w2 = {
        "t0": changed(w["t0"], 0.01, 5),
        "t1": torch.randint(-32768, 32767, (3000,), dtype=torch.int16).view(torch.bfloat16),
        "t2": w["t2"],
        "new": w["t3"],
    }
    kinds = {n: (x.patch.kind if isinstance(x, Patched) else "dense") for n, x in db.encode(w2.items())}
    assert kinds["t0"] == "sparse" and kinds["t2"] == "same" and kinds["new"] == "dense"
    assert kinds["t1"] == "dense"  # random bits: dense, written over the copy in place
    db.rollback()
    assert set(db._t) == set(snapshot) - {"t1"}  # what was overwritten whole is dropped
    for k, (v, _) in db._t.items():
        assert torch.equal(v.view(torch.int16), snapshot[k].view(torch.int16))
        assert db._part(k) == delta.part(k, snapshot[k])  # a part it kept is the tensor's
    # committed instead, the copy is the new weights (t1 sent dense: no copy of it left)
    kinds = {n: (x.patch.kind if isinstance(x, Patched) else "dense") for n, x in db.encode(w2.items())}
    assert kinds["t1"] == "dense" and kinds["t0"] == "sparse"
    db.commit(2)
    assert db.version == 2 and torch.equal(db._t["t0"][0].view(torch.int16), w2["t0"].view(torch.int16))


def _two_versions():
    """Version 1 (two tensors) as dense buckets, version 2 (one of them changed) as patches."""
    w = {"a": tensor(torch.float32, 2000, 1), "b": tensor(torch.float32, 2000, 2)}
    db = DeltaBase()
    dense = list(iter_buckets(db.record(w.items()), 1 << 20))
    db.commit(1)
    w2 = {"a": changed(w["a"], 0.01, 3), "b": w["b"]}
    patches = list(iter_buckets(db.encode(w2.items()), 1 << 20))
    return w, w2, dense, patches


def test_an_engines_base_rebuilds_a_chain_in_one_sync_and_keeps_only_what_finalized():
    w, w2, dense, patches = _two_versions()
    store = BaseStore(True)
    for b in dense + patches:  # a replay: the dense version, then its delta, one sync
        tensors, _, skip = store.rebuild(b.tensors, b.frame())
        store.stage_loaded(tensors, None, skip)
    store.discard()  # aborted: nothing kept
    with pytest.raises(WeightSyncError) as ei:
        store.rebuild(patches[0].tensors, patches[0].frame())
    assert ei.value.code is ErrorCode.STALE_BASE
    for b in dense + patches:
        tensors, _, skip = store.rebuild(b.tensors, b.frame())
        store.stage_loaded(tensors, None, skip)
    store.commit()
    got, _ = store._get("a")
    assert got is not None and torch.equal(got, w2["a"])


def test_the_spool_stores_a_delta_as_its_base_then_its_patches_across_a_restart(tmp_path):
    sp = Spool(tmp_path)
    sp.begin("s1", 1)
    sp.add("s1", 0, 0, [{"name": "a", "dtype": "uint8", "shape": [3], "offset": 0, "nbytes": 3}], 1, b"abc")
    sp.commit("s1", 1, "d1")
    sp.begin("s2", 2, base=1)
    sp.add("s2", 0, 0, [{"name": "a", "dtype": "uint8", "shape": [3], "offset": 0, "nbytes": 0}], 2, b"")
    info = sp.commit("s2", 2, "d2")
    assert info is not None and (info.version, info.buckets, info.chain) == (2, 2, 1)
    again = Spool(tmp_path)
    assert again.info is not None and again.info.chain == 1
    assert [(e.gen, again.read(e)) for e in again.entries()] == [(0, b"abc"), (1, b"")]
    # a delta on a version the spool does not hold cannot be replayed: not spooled
    again.begin("s3", 3, base=1)
    again.add("s3", 0, 0, [], 3, b"x")
    assert again.commit("s3", 3, "d3") is None and "not the spooled version" in (again.error or "")


def core_at(version: int, *, delta: bool = True, chain: int = 0, spool: bool = True) -> Core:
    o = Core(Limits(min_engines=1, spool=spool, max_delta_chain=2))
    o.handle(ev.EngineRegistered(Register(engine_id="e", backend="torch", delta=delta)), 0.0)
    o.handle(ev.BeginSync(Begin(sync_id="s1", version=version)), 1.0)
    o.handle(ev.BucketIn(schema.Bucket(sync_id="s1", seq=0, tensors=(), checksum=0), 16), 1.0)
    o.handle(ev.Loaded("e", "s1", (0, 0)), 1.0)
    o.handle(ev.FinishSync(schema.Finish(sync_id="s1", buckets=1)), 1.0)
    o.handle(
        ev.EngineFinalized(
            "e", schema.Finalized(sync_id="s1", version=version, digest="d", finalize_count=1)
        ),
        1.0,
    )
    o.spooled = Spooled(version, "d", 1, (), chain) if spool else None
    return o


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ({"base": 4}, "the delta applies to version 4, the fleet serves 5"),
        ({"delta": False}, "engine e keeps no base copy"),
        ({"chain": 2}, "max_delta_chain 2"),
        ({"spooled_other": True}, "the spool does not hold version 5"),
        ({"spooled_scheme": LEGACY_DIGEST_SCHEME}, "digest scheme (DIGEST_SCHEME_MISMATCH)"),
        ({"collective": True}, "engine e receives broadcast buckets in its own workers"),
    ],
)
def test_the_core_refuses_a_delta_the_fleet_cannot_rebuild_and_changes_nothing(case, why):
    o = core_at(5, delta=case.get("delta", True), chain=case.get("chain", 0))
    if case.get("spooled_other"):
        o.spooled = Spooled(4, "d", 1)
    if case.get("spooled_scheme"):  # an older daemon's spool of the served version
        o.spooled = Spooled(5, "d", 1, scheme=case["spooled_scheme"])
    before = (o.state, o.last_ready_version, o.sync)
    offer = (
        schema.CollectiveOffer(host="127.0.0.1", port=29500, session="t") if case.get("collective") else None
    )
    with pytest.raises(WeightSyncError) as ei:
        o.handle(ev.BeginSync(Begin(sync_id="s2", version=6, base=case.get("base", 5), offer=offer)), 2.0)
    assert ei.value.code is ErrorCode.STALE_BASE and why in ei.value.message
    assert (o.state, o.last_ready_version, o.sync) == before
    ok = core_at(5)
    ok.handle(ev.BeginSync(Begin(sync_id="s2", version=6, base=5)), 2.0)
    assert ok.state.value == "LOADING_BUCKETS"


def test_a_tensor_past_float32_precision_is_sampled_within_bounds():
    n = (1 << 24) + 7  # float32 cannot count this far exactly
    base = torch.zeros(n, dtype=torch.uint8)
    new = base.clone()
    new[-1] = 1
    enc, _ = delta.encode("w", new, base, lambda: delta.part("w", base))
    assert enc.patch is not None and enc.patch.kind == "sparse" and enc.changed == 1
    every = torch.ones(n, dtype=torch.uint8)  # changed everywhere: the sample says dense
    enc, _ = delta.encode("w", every, base, lambda: delta.part("w", base))
    assert enc.patch is None


def test_an_engines_in_place_patches_are_undone_exactly_and_unchanged_tensors_load_only_when_needed():
    w1 = {"a": tensor(torch.bfloat16, 3000, 1), "b": tensor(torch.bfloat16, 3000, 2)}
    db = DeltaBase()
    (dense,) = iter_buckets(db.record(w1.items()), 1 << 20)
    db.commit(1)
    store = BaseStore(True)
    tensors, _, skip = store.rebuild(dense.tensors, dense.frame())
    store.stage_loaded(tensors, None, skip)
    store.commit()  # finalized: the model holds the base
    w2 = {"a": changed(w1["a"], 0.01, 3), "b": w1["b"]}
    (p2,) = iter_buckets(db.encode(w2.items()), 1 << 20)
    db.commit(2)
    w3 = {"a": changed(w2["a"], 0.01, 4), "b": w1["b"]}
    (p3,) = iter_buckets(db.encode(w3.items()), 1 << 20)
    # two patches on the same base tensor in one sync (a replay), then an abort
    loaded = [store.rebuild(p.tensors, p.frame(), skip_same=True)[0] for p in (p2, p3)]
    assert [[n for n, _, _ in ts] for ts in loaded] == [["a"], ["a"]]  # "b" unchanged, in the model
    assert torch.equal(loaded[1][0][2].view(torch.int16), w3["a"].view(torch.int16))
    store.discard()
    got, part = store._get("a")
    assert got is not None and torch.equal(got.view(torch.int16), w1["a"].view(torch.int16))
    assert part == delta.part("a", w1["a"])
    # the aborted sync may have left its tensors in the model: "b" is loaded again now
    tensors, _, _ = store.rebuild(p2.tensors, p2.frame(), skip_same=True)
    assert [n for n, _, _ in tensors] == ["a", "b"]
    store.discard()
    # a dense tensor is staged into the base's own memory; an abort then drops it whole
    tensors, _, skip = store.rebuild(dense.tensors, dense.frame())
    store.stage_loaded(tensors, None, skip)
    store.discard()
    assert store._get("a") == (None, None) and store._get("b") == (None, None)


def test_a_delta_push_is_cut_into_buckets_where_the_dense_push_would_be():
    w = {f"t{i}": tensor(torch.float32, 4096, i) for i in range(8)}  # 16 KiB each
    db = DeltaBase()
    dense = list(iter_buckets(db.record(w.items()), 40 << 10))
    db.commit(1)
    w2 = {k: changed(v, 0.001, 3) for k, v in w.items()}
    patched = list(iter_buckets(db.encode(w2.items()), 40 << 10))
    assert [[m.name for m in b.tensors] for b in patched] == [[m.name for m in b.tensors] for b in dense]
    assert len(patched) == 4 and all(m.patch is not None for b in patched for m in b.tensors)


def test_an_engine_without_a_base_rebuilds_a_held_replay_and_keeps_nothing_after_it():
    """Off (no --delta-base): a replay of base + deltas is refused unless its buckets say
    `hold`; held, the chain rebuilds in one sync, and nothing is kept once it ends (the
    engine still holds no base, so it still registers without `delta`)."""
    w, w2, dense, patches = _two_versions()
    store = BaseStore(False)
    for b in dense:
        store.stage_loaded(list(store.rebuild(b.tensors, b.frame())[0]), None, set())
    with pytest.raises(WeightSyncError) as ei:  # not held: nothing was kept to patch
        store.rebuild(patches[0].tensors, patches[0].frame())
    assert ei.value.code is ErrorCode.STALE_BASE
    store.discard()
    store.hold()
    out = []
    for b in dense + patches:
        tensors, _, skip = store.rebuild(b.tensors, b.frame())
        store.stage_loaded(tensors, None, skip)
        out += tensors
    assert torch.equal({n: t for n, _, t in out}["a"], w2["a"]) and not torch.equal(w2["a"], w["a"])
    assert store.nbytes > 0
    store.commit()
    assert store.nbytes == 0 and not store.held and not store.holding


def test_a_base_emptied_by_bytes_the_store_never_saw_is_not_held():
    store = BaseStore(True)
    store.stage(("a", None), tensor(torch.float32, 100, 1))
    store.commit()
    assert store.held
    store.invalidate()  # a collective sync the engine's own workers received
    store.commit()
    assert not store.held


def test_a_delta_goes_dense_where_the_link_outran_the_encoding_and_is_tried_again():
    """Pure: a transport whose delta pushes took longer per model byte than its dense ones
    gets dense pushes (saying why), with delta tried again every RETRY_DELTA; one where
    delta paid, or a model too small to judge, keeps delta."""
    from orchestrator.trainer.delta import JUDGED_BYTES, RETRY_DELTA, DeltaChooser

    c = DeltaChooser()
    assert c.choose("shm")[0]  # nothing measured
    big = 4 * JUDGED_BYTES
    c.record("shm", "shm", "dense", 0.8, big)
    c.record("shm", "shm", "delta", 1.1, big)
    c.record("inline", "inline", "dense", 1.8, big)
    c.record("inline", "inline", "delta", 1.0, big)
    go, why = c.choose("shm")
    assert not go and "the link outruns the encoding" in why and "on shm" in why
    assert c.choose("inline")[0]
    tries = [c.choose("shm")[0] for _ in range(2 * RETRY_DELTA)]
    assert tries.count(True) == 2 and tries[RETRY_DELTA - 2] and tries[2 * RETRY_DELTA - 2]  # every 8th
    c.record("shm", "shm", "delta", 0.3, big)  # the retry paid: averaged, delta now wins
    c.record("shm", "shm", "delta", 0.3, big)
    assert c.choose("shm")[0]
    small = DeltaChooser()
    small.record("shm", "shm", "dense", 0.01, JUDGED_BYTES // 8)
    small.record("shm", "shm", "delta", 0.05, JUDGED_BYTES // 8)
    assert small.choose("shm")[0]


def test_the_delta_chooser_keys_measurements_by_the_transport_the_daemon_chose():
    """Pure: pushes that asked for "auto" are measured under what the daemon chose (shm,
    then inline), never under "auto"; a push asking "auto" is judged by the link it got last."""
    from orchestrator.trainer.delta import JUDGED_BYTES, DeltaChooser

    c = DeltaChooser()
    big = 4 * JUDGED_BYTES
    c.record("auto", "shm", "dense", 0.8, big)
    c.record("auto", "shm", "delta", 1.1, big)
    assert set(c.paces) == {"shm"} and c.answered == {"auto": "shm"}
    go, why = c.choose("auto")
    assert not go and "on shm" in why
    assert c.choose("inline")[0] and c.choose("shm")[0] is False
    c.record("auto", "inline", "dense", 1.8, big)  # the daemon now answers inline (no shm)
    c.record("auto", "inline", "delta", 1.0, big)
    assert set(c.paces) == {"shm", "inline"} and c.choose("auto")[0]  # judged on inline


def test_a_delta_to_ranks_that_take_boxes_patches_each_box_against_the_box_that_rank_holds():
    """The trainer's copy stays whole; with the engines' cuts it encodes each box against
    the same box of the copy (the parts are the boxes', the version's digest the whole's).
    The engine keeps each box it loaded under (name, box) and rebuilds the box's patch on
    it, bit-exact; a box's patch finds no base in a store that holds the whole tensor."""
    from messages.buckets import Digester, digest
    from messages.cuts import Cuts, Planned, cut, part_digest
    from messages.slices import WHOLE

    rows = ((0, 32), (0, 64)), ((32, 32), (0, 64))
    cuts = Cuts({"k": [{"q": rows[0], "n": WHOLE}, {"q": rows[1], "n": WHOLE}]})
    w1 = {"q": tensor(torch.bfloat16, 64 * 64, 1).view(64, 64), "n": tensor(torch.bfloat16, 64, 2)}
    db = DeltaBase()
    dense = list(iter_buckets(cuts.items(db.record(w1.items()), Digester()), 1 << 20))
    db.commit(1)
    assert {m.box for b in dense for m in b.tensors} == {None, *rows}
    store = BaseStore(True)
    for b in dense:
        loaded, _, skip = store.rebuild(b.tensors, b.frame())
        store.stage_loaded(loaded, None, skip)
    store.commit()

    w2 = {"q": changed(w1["q"], 0.01, 3), "n": w1["n"]}
    planned, digester = Planned(), Digester()
    planned.cuts, planned.digester = cuts, digester
    (b2,) = iter_buckets(
        cuts.items(db.encode(w2.items(), planned=planned), digester), 1 << 20, digester=digester
    )
    metas = {(m.name, m.box): m for m in b2.tensors}
    assert set(metas) == {("q", rows[0]), ("q", rows[1]), ("n", None)}
    assert all(m.patch is not None and m.shape == (64, 64) for k, m in metas.items() if k[0] == "q")
    assert metas[("n", None)].patch.kind == "same"
    codec._check_tensors(b2.tensors, int(b2.data.numel()))  # a patch of a box passes the codec
    assert digester.hexdigest() == digest(w2.items())  # the whole model's, never the boxes'
    for box in rows:
        assert digester.slices[("q", box)] == part_digest("q", (64, 64), box, cut(w2["q"], box))

    loaded, _, _ = store.rebuild(b2.tensors, b2.frame(), skip_same=True)
    got = {(n, p): t for n, p, t in loaded}
    assert set(got) == {("q", rows[0]), ("q", rows[1])}  # "n" unchanged, already loaded
    for box in rows:
        assert torch.equal(got[("q", box)].view(torch.int16), cut(w2["q"], box).view(torch.int16))

    # a store that holds the whole (a push that was not cut) patches the box cut from it;
    # once that sync finalizes, it holds the boxes, not the whole
    whole = BaseStore(True)
    (d1,) = iter_buckets(w1.items(), 1 << 20)
    loaded, _, skip = whole.rebuild(d1.tensors, d1.frame())
    whole.stage_loaded(loaded, None, skip)
    whole.commit()
    loaded, _, skip = whole.rebuild(b2.tensors, b2.frame())
    whole.stage_loaded(loaded, None, skip)
    whole.commit()
    assert whole._get("q") == (None, None)
    for box in rows:
        got_box, part = whole._get("q", box, (64, 64))
        assert torch.equal(got_box.view(torch.int16), cut(w2["q"], box).view(torch.int16))
        assert part == part_digest("q", (64, 64), box, cut(w2["q"], box))
    # the whole of another version is no base for those patches
    other = BaseStore(True)
    (d2,) = iter_buckets({"q": changed(w1["q"], 0.5, 9), "n": w1["n"]}.items(), 1 << 20)
    loaded, _, skip = other.rebuild(d2.tensors, d2.frame())
    other.stage_loaded(loaded, None, skip)
    other.commit()
    with pytest.raises(WeightSyncError) as ei:
        other.rebuild(b2.tensors, b2.frame())
    assert ei.value.code is ErrorCode.STALE_BASE
