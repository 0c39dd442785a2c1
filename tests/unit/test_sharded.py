"""A sharded push in the pure core (sources joining one sync, duplicates, the digest over
the union, the deadlines naming a source) and the trainer's plan."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages.checksums import add_digests, combine
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Begin, Bucket, Finalized, Finish, ParamSpec, Register, TensorMeta
from messages.shardplan import plan_key
from orchestrator.core import Core, Limits, State
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev
from orchestrator.trainer.shard import ShardPlans, plan_shards

ENGINES = ("e0", "e1")
NAMES = ("a", "b", "c", "d")
SPEC = tuple(ParamSpec(name=n, dtype="float32", shape=(4,)) for n in NAMES)
PLAN = plan_key(2, {"a": 0, "b": 0, "c": 1, "d": 1})  # the hash of this assignment


def new(**lim) -> Core:
    o = Core(Limits(min_engines=2, **lim))
    for e in ENGINES:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch", spec=SPEC)), 0.0)
    return o


def begin(o, source, sources=2, sync_id=None, version=1, plan=None, at=1.0, seat=None):
    msg = Begin(
        sync_id=sync_id or f"own-{source}",
        version=version,
        sources=sources,
        source=source,
        plan=plan,
        seat=source if seat is None else seat,
    )
    return o.handle(ev.BeginSync(msg), at)


def bucket(o, source, seq, names, at=1.0, size=None, seat=None, checksum=0):
    metas = tuple(TensorMeta(n, "float32", (4,), 64 * i, 16) for i, n in enumerate(names))
    msg = Bucket(
        sync_id=o.sync.sync_id,
        seq=seq,
        tensors=metas,
        checksum=checksum,
        source=source,
        size=size,
        seat=source if seat is None else seat,
    )
    return o.handle(ev.BucketIn(msg, 64 * len(names)), at)


def applied(o, source, seq):
    for e in ENGINES:
        o.handle(ev.Loaded(e, o.sync.sync_id, (source, seq)), 1.0)


def finish(o, source, n, digest=None, partial=False):
    msg = Finish(
        sync_id=o.sync.sync_id, buckets=n, source=source, digest=digest, partial=partial, seat=source
    )
    return o.handle(ev.FinishSync(msg), 1.0)


def test_the_second_source_joins_the_sync_the_first_opened_under_its_name():
    o = new()
    r0 = begin(o, 0, sync_id="first")
    r1 = begin(o, 1, sync_id="second")
    assert r0.reply["sync_id"] == r1.reply["sync_id"] == "first" == o.sync.sync_id
    assert not r1.reply["repeated"] and begin(o, 1, sync_id="again").reply["repeated"]
    assert sorted(o.sync.begun) == [0, 1]
    view = o.snapshot(1.0)["sync"]
    assert view["source_count"] == 2 and [x["begun"] for x in view["sources"]] == [True, True]


@pytest.mark.parametrize("field", ["sources", "plan", "version", "sync_id"])
def test_a_source_that_disagrees_on_the_count_the_plan_or_the_version_fails_the_sync_for_all(field):
    """Each source hears what disagreed at once (the opener no longer waits for --sync-timeout)."""
    o = new()
    begin(o, 0, sources=2, plan=7)
    kw = {"sources": 3, "plan": 8, "version": 2, "sync_id": "own-0"}
    extra = {"version": 2} if field == "sync_id" else {}  # the opener's sync_id, another version
    res = begin(o, 1, **{"sources": 2, "plan": 7, field: kw[field], **extra})
    word = {
        "sources": "3 sources",
        "plan": "plan 7",
        "version": "began version 2",
        "sync_id": "began version 2 under the same sync_id 'own-0'",
    }[field]
    err = res.refusal
    assert err is not None and err.code is ErrorCode.SOURCE_CONFLICT and word in err.message
    assert err.details["disagreed"] == ("version" if field == "sync_id" else field)
    assert err.details["source"] == 1
    assert o.sync is None and o.last_sync["code"] == "SOURCE_CONFLICT"
    done = [c for c in res.commands if isinstance(c, cmd.CompleteSync)]
    assert [c.error for c in done] == [err]  # the opener's parked requests hear the same


def test_a_bucket_of_a_source_that_has_not_begun_is_refused():
    o = new()
    begin(o, 0)
    with pytest.raises(WeightSyncError) as ei:
        bucket(o, 1, 0, ["a"])
    assert ei.value.code is ErrorCode.BAD_MESSAGE and "has not begun" in ei.value.message


def test_a_tensor_another_source_sent_is_refused_before_it_is_forwarded():
    o = new()
    begin(o, 0)
    begin(o, 1)
    assert cmd.ForwardBucket in {type(c) for c in bucket(o, 0, 0, ["a", "b"]).commands}
    with pytest.raises(WeightSyncError) as ei:
        bucket(o, 1, 0, ["c", "b"])
    assert ei.value.code is ErrorCode.DUPLICATE_TENSOR
    assert ei.value.details == {"tensor": "b", "source": 1, "other_source": 0}
    assert (1, 0) not in o.sync.buckets  # refused whole: nothing of it recorded
    bucket(o, 1, 0, ["c", "d"])  # the source may still send its own part


def _through_finish(o, digests):
    begin(o, 0)
    begin(o, 1)
    bucket(o, 0, 0, ["a", "b"])
    bucket(o, 1, 0, ["c", "d"])
    applied(o, 0, 0)
    applied(o, 1, 0)
    first = finish(o, 0, 1, digests[0])
    assert first.later and not cmds(first, cmd.SendFinalize)  # parked: source 1 still streams
    return finish(o, 1, 1, digests[1])


def cmds(res, kind):
    return [c for c in res.commands if isinstance(c, kind)]


def test_each_engine_finalizes_once_after_the_last_source_and_must_hold_the_sum_of_digests():
    o = new()
    d0, d1 = combine([b"\x01" * 16]), combine([b"\x02" * 16])
    last = _through_finish(o, (d0, d1))
    assert sorted(c.engine_id for c in cmds(last, cmd.SendFinalize)) == list(ENGINES)
    want = add_digests([d0, d1])
    assert o.sync.expected_digest == want == combine([b"\x01" * 16, b"\x02" * 16])
    o.handle(ev.EngineFinalized("e0", Finalized(sync_id=o.sync.sync_id, version=1, digest=want)), 2.0)
    res = o.handle(ev.EngineFinalized("e1", Finalized(sync_id=o.sync.sync_id, version=1, digest=d0)), 2.0)
    assert o.state is State.IDLE and o.last_sync["code"] == "ENGINE_FAILED"  # not the version's digest
    assert cmds(res, cmd.CompleteSync)


def test_a_tensor_no_source_sent_is_refused_at_the_last_finish():
    o = new()
    begin(o, 0)
    begin(o, 1)
    bucket(o, 0, 0, ["a", "b"])
    bucket(o, 1, 0, ["c"])
    applied(o, 0, 0)
    applied(o, 1, 0)
    finish(o, 0, 1)
    with pytest.raises(WeightSyncError) as ei:
        finish(o, 1, 1)
    assert ei.value.code is ErrorCode.INCOMPLETE_SYNC and "d" in ei.value.details["missing"]
    assert o.state is State.LOADING_BUCKETS and not o.sync.finalize_sent


def test_a_source_that_never_begins_fails_the_sync_named_at_the_sync_timeout():
    o = new(sync_timeout=10.0)
    begin(o, 0, sources=3)
    begin(o, 2, sources=3, at=2.0)
    o.handle(ev.Tick(), 10.5)
    assert o.state is State.LOADING_BUCKETS
    bucket(o, 0, 0, ["a"], at=10.6)
    bucket(o, 2, 0, ["b"], at=10.6)
    o.handle(ev.Tick(), 11.5)
    assert o.state is State.IDLE
    assert o.last_sync["code"] == "TIMEOUT" and "source(s) [1] of 3 never began" in o.last_sync["reason"]


def test_a_source_whose_connection_closed_fails_the_sync_for_all_after_the_grace():
    o = new(trainer_grace=2.0)
    begin(o, 0)
    begin(o, 1)
    o.handle(ev.TrainerGone(o.sync.sync_id, 1), 3.0)
    bucket(o, 0, 0, ["a"], at=4.0)  # source 0 is heard; source 1's grace runs on
    o.handle(ev.Tick(), 4.9)
    assert o.state is State.LOADING_BUCKETS
    o.handle(ev.Tick(), 5.1)
    assert o.last_sync["code"] == "ABORTED" and "source(s) [1] of 2" in o.last_sync["reason"]
    assert [x["connected"] for x in o.last_sync["sources"]] == [True, False]


def test_a_silent_source_fails_the_sync_but_one_that_finished_may_wait():
    o = new(sync_timeout=10.0)
    begin(o, 0)
    begin(o, 1)
    bucket(o, 0, 0, ["a", "b"])
    applied(o, 0, 0)
    finish(o, 0, 1)  # source 0 is done and waits for source 1
    bucket(o, 1, 0, ["c"], at=5.0)
    o.handle(ev.Tick(), 14.0)
    assert o.state is State.LOADING_BUCKETS
    o.handle(ev.Tick(), 15.5)
    assert o.last_sync["code"] == "TIMEOUT" and "source(s) [1]" in o.last_sync["reason"]


@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=40, unique=True), st.data())
def test_digests_of_disjoint_parts_add_up_to_the_union(parts, data):
    cut = data.draw(st.integers(0, len(parts)))
    assert add_digests([combine(parts[:cut]), combine(parts[cut:])]) == combine(parts)
    assert combine(list(reversed(parts))) == combine(parts)


def test_the_plan_balances_bytes_is_deterministic_and_replayed():
    metas = [(f"t{i}", (i + 1,), "float32", 4 * (i + 1) ** 2) for i in range(50)]
    p = plan_shards(metas, 4)
    assert p == plan_shards(list(reversed(metas)), 4)  # order of the metadata does not matter
    assert sorted(p.owner) == sorted(m[0] for m in metas) and set(p.owner.values()) == {0, 1, 2, 3}
    assert sum(p.loads) == sum(m[3] for m in metas) and p.imbalance < 1.05
    assert plan_shards(metas, 3).key != p.key
    plans = ShardPlans()
    assert plans.get(metas, 4) is plans.get(metas, 4) and plans.computed == 1
    assert plans.get(metas[:-1], 4).key != p.key and plans.computed == 2


def test_a_source_that_comes_to_its_sync_after_it_failed_hears_how_it_ended():
    o = new()
    begin(o, 0, sync_id="shared")
    o.handle(ev.AbortSync("shared", "gave up"), 2.0)
    with pytest.raises(WeightSyncError) as ei:
        begin(o, 1, sync_id="shared")  # late: not a new sync it would wait in alone
    assert ei.value.code is ErrorCode.ABORTED and "gave up" in ei.value.message
    assert o.sync is None


def test_over_the_collective_each_source_broadcasts_from_a_group_of_its_own():
    from messages.schema import CollectiveOffer

    o = Core(Limits(min_engines=2))
    for e in ENGINES:
        reg = Register(
            engine_id=e, backend="torch", spec=SPEC, collective_ranks=1, collective_backends=("gloo",)
        )
        o.handle(ev.EngineRegistered(reg), 0.0)

    def offer(k):
        return CollectiveOffer(host="127.0.0.1", port=4000 + k, session=f"session-{k}")

    r = [
        o.handle(
            ev.BeginSync(
                Begin(
                    sync_id=f"own-{k}",
                    version=1,
                    sources=3,
                    source=k,
                    transport="collective",
                    offer=offer(k),
                    seat=k,
                )
            ),
            1.0,
        ).reply
        for k in (0, 1)
    ]
    assert [x["transport"] for x in r] == ["collective", "collective"]
    assert [x["collective"]["store"] for x in r] == ["127.0.0.1:4000", "127.0.0.1:4001"]
    groups = o.sync.groups
    assert groups[0].id != groups[1].id and {g.world_size for g in groups.values()} == {3}
    fwd = [
        c
        for k in (0, 1)
        for c in bucket(o, k, 0, [NAMES[k]], size=16).commands
        if isinstance(c, cmd.ForwardBucket)
    ]
    assert [f.group.id for f in fwd] == [groups[0].id, groups[1].id]  # each bucket from its source's group
    # a source that offers no store cannot join a collective sync: refused, nothing changed
    with pytest.raises(WeightSyncError) as ei:
        o.handle(ev.BeginSync(Begin(sync_id="x", version=1, sources=3, source=2)), 1.0)
    assert ei.value.code is ErrorCode.BAD_MESSAGE and "must offer its store" in ei.value.message
    assert sorted(o.sync.begun) == [0, 1]


def _ready(o, version, parts, plan):
    """A sharded sync of `parts` (source k sends parts[k], one bucket) through READY."""
    for k in range(len(parts)):
        begin(o, k, sources=len(parts), version=version, plan=plan, sync_id=f"v{version}")
    for k, names in enumerate(parts):
        bucket(o, k, 0, names)
        applied(o, k, 0)
    for k in range(len(parts)):
        finish(o, k, 1)
    for e in ENGINES:
        o.handle(ev.EngineFinalized(e, Finalized(sync_id=o.sync.sync_id, version=version, digest="d")), 2.0)
    assert o.state is State.READY


def test_later_syncs_with_a_plan_are_checked_against_it_as_first_carried_out():
    o = new()
    _ready(o, 1, [["a", "b"], ["c", "d"]], plan=PLAN)
    assert o.plans[PLAN] == {"a": 0, "b": 0, "c": 1, "d": 1}
    begin(o, 0, version=2, plan=PLAN, sync_id="v2")
    begin(o, 1, version=2, plan=PLAN, sync_id="v2")
    with pytest.raises(WeightSyncError) as ei:  # "a" is source 0's: refused before source 0 sent it
        bucket(o, 1, 0, ["c", "a"])
    assert ei.value.code is ErrorCode.DUPLICATE_TENSOR and f"plan {PLAN} gives source 0" in ei.value.message
    assert ei.value.details["other_source"] == 0 and (1, 0) not in o.sync.buckets
    bucket(o, 0, 0, ["a", "b"])
    bucket(o, 1, 0, ["c"])  # source 1 leaves "d" out
    applied(o, 0, 0)
    applied(o, 1, 0)
    finish(o, 0, 1)
    with pytest.raises(WeightSyncError) as ei:
        finish(o, 1, 1)
    assert ei.value.code is ErrorCode.INCOMPLETE_SYNC and ei.value.details["sources"] == [1]
    assert "the plan gives them to source(s) [1]" in ei.value.message


def test_another_plan_is_not_checked_against_the_first():
    o = new()
    _ready(o, 1, [["a", "b"], ["c", "d"]], plan=PLAN)
    begin(o, 0, version=2, plan=7, sync_id="v2")
    begin(o, 1, version=2, plan=7, sync_id="v2")
    bucket(o, 1, 0, ["a", "b"])  # plan 7 gives them to source 1: taken
    assert (1, 0) in o.sync.buckets


# -- a source is who began it ----------------------------------------------------------------
@pytest.mark.parametrize("how", ["begin", "bucket", "finish"])
def test_a_second_claim_on_a_sources_seat_fails_the_sync_for_every_source(how):
    """Another token's begin, bucket or finish for a held seat: refused SOURCE_CONFLICT naming
    the source, the sync failed (nothing forwarded from the claimant), not taken over."""
    o = new()
    begin(o, 0)
    begin(o, 1)
    bucket(o, 1, 0, ["c"])
    assert begin(o, 1, seat=1).reply["repeated"]  # the holder's own resend: answered again
    if how == "begin":
        res = begin(o, 1, seat=99)
    elif how == "bucket":
        res = bucket(o, 1, 0, ["c"], seat=99)  # "resends" seq 0, same size
    else:
        msg = Finish(sync_id=o.sync.sync_id, buckets=1, source=1, seat=99)
        res = o.handle(ev.FinishSync(msg), 1.0)
    err = res.refusal
    assert err is not None and err.code is ErrorCode.SOURCE_CONFLICT, res
    assert "source 1 of sync 'own-0'" in err.message and "two processes push as source 1" in err.message
    assert err.details["disagreed"] == "seat" and err.details["source"] == 1
    assert not any(isinstance(c, cmd.ForwardBucket) for c in res.commands)
    assert o.sync is None and o.last_sync["code"] == "SOURCE_CONFLICT"


def test_without_a_token_a_seat_belongs_to_the_connection_that_began_it():
    o = new()
    o.handle(ev.BeginSync(Begin(sync_id="s", version=1, sources=2, source=0), conn=b"A"), 1.0)
    o.handle(ev.BeginSync(Begin(sync_id="t", version=1, sources=2, source=1), conn=b"B"), 1.0)
    again = o.handle(ev.BeginSync(Begin(sync_id="t", version=1, sources=2, source=1), conn=b"B"), 1.0)
    assert again.reply["repeated"]
    res = o.handle(ev.BeginSync(Begin(sync_id="u", version=1, sources=2, source=1), conn=b"C"), 1.0)
    assert res.refusal is not None and res.refusal.code is ErrorCode.SOURCE_CONFLICT
    assert "from a connection other than" in res.refusal.message and o.sync is None


def test_a_resent_bucket_is_compared_by_checksum_not_size():
    """The same size with other bytes is refused; the first bucket stands, still pending."""
    o = new()
    begin(o, 0)
    begin(o, 1)
    bucket(o, 0, 0, ["a"], checksum=5)
    with pytest.raises(WeightSyncError) as ei:
        bucket(o, 0, 0, ["a"], checksum=6)
    assert (
        ei.value.code is ErrorCode.BAD_MESSAGE and "resent bucket seq 0 with other bytes" in ei.value.message
    )
    assert o.sync.buckets[(0, 0)].checksum == 5
    assert bucket(o, 0, 0, ["a"], checksum=5).later  # a true resend: acked when applied


def test_sources_that_did_not_send_what_their_plan_declares_fail_even_partial():
    """Ownership comes from the plan the sources declared (its hash), not from a first READY
    sync: a partial push whose sources swapped a tensor never commits."""
    o = new()
    plan = plan_key(2, {"a": 0, "b": 1})
    begin(o, 0, plan=plan)
    begin(o, 1, plan=plan)
    bucket(o, 0, 0, ["b"])  # the plan gives "b" to source 1 and "a" to source 0
    bucket(o, 1, 0, ["a"])
    applied(o, 0, 0)
    applied(o, 1, 0)
    finish(o, 0, 1, partial=True)
    res = finish(o, 1, 1, partial=True)
    assert res.refusal is not None and res.refusal.code is ErrorCode.SOURCE_CONFLICT
    assert f"plan {plan}" in res.refusal.message and res.refusal.details["disagreed"] == "plan"
    assert not any(isinstance(c, cmd.SendFinalize) for c in res.commands)
    assert o.sync is None and o.plans == {}  # a wrong map is never kept


def test_a_plan_carried_out_as_declared_commits_and_is_kept():
    o = new()
    _ready(o, 1, [["a", "b"], ["c", "d"]], plan=PLAN)
    assert o.state is State.READY and o.plans[PLAN] == {"a": 0, "b": 0, "c": 1, "d": 1}


def test_a_second_claim_once_every_source_finished_is_refused_and_the_commit_goes_on():
    o = new()
    for k in (0, 1):
        begin(o, k)
    for k, names in enumerate([["a", "b"], ["c", "d"]]):
        bucket(o, k, 0, names)
        applied(o, k, 0)
    for k in (0, 1):
        finish(o, k, 1)
    assert o.state is State.FINALIZING
    with pytest.raises(WeightSyncError) as ei:
        begin(o, 1, seat=99)
    assert ei.value.code is ErrorCode.SOURCE_CONFLICT and "the sync goes on" in ei.value.message
    assert o.state is State.FINALIZING and o.sync is not None
