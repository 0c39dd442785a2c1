"""The core's per-rank check (engines that take slices): a finalize whose rank digests
differ from what the sender computed, or from what the spool recorded for a replay, is
refused naming the rank; the spooled version carries each rank's digest."""

from __future__ import annotations

from messages.schema import Finalize, Finalized, ParamSpec, Register, Slices
from orchestrator.core import Spooled
from orchestrator.core import commands as fsm
from orchestrator.core import events as ev
from tests.unit.test_fsm_recovery import ready_v1_spooled

SPEC = (ParamSpec("w", "float32", (4, 2)), ParamSpec("n", "float32", (2,)))
RANKS = ({"w": ((0, 2), (0, 2)), "n": "whole"}, {"w": ((2, 2), (0, 2)), "n": "whole"})
SLICES = Slices(key="abc", rank_bytes=(24, 24), ranks=RANKS)


def _register_sliced(o, eid: str):
    return o.handle(
        ev.EngineRegistered(Register(engine_id=eid, backend="torch", spec=SPEC, slices=SLICES)), 5.0
    )


def _catch_up(o, eid: str, ranks: tuple[str, ...]):
    res = _register_sliced(o, eid)
    (start,) = [c for c in res.commands if isinstance(c, fsm.SendSpooled)]
    out = o.handle(ev.Loaded(eid, start.sync_id, (0, 0)), 5.0)
    (fin,) = [c for c in out.commands if isinstance(c, fsm.SendFinalize)]
    assert fin.digest == "d"  # the version's digest goes with the finalize
    return o.handle(
        ev.EngineFinalized(
            eid, Finalized(sync_id=start.sync_id, version=1, digest="d", finalize_count=1, rank_digests=ranks)
        ),
        5.0,
    )


def test_a_catch_up_by_slices_is_checked_rank_by_rank_against_the_spool():
    o = ready_v1_spooled()
    o.handle(ev.SpoolChanged(Spooled(1, "d", 1, slice_digests={"abc": ("a0", "a1")})), o.now)
    out = _catch_up(o, "e2", ("a0", "a1"))
    assert o.engines["e2"].state == "READY" and o.engines["e2"].version == 1
    assert [c.ok for c in out.commands if isinstance(c, fsm.CatchUpDone)] == [True]
    out = _catch_up(o, "e3", ("a0", "bad"))
    assert o.engines["e3"].state != "READY" and o.engines["e3"].version is None
    (done,) = [c for c in out.commands if isinstance(c, fsm.CatchUpDone)]
    assert not done.ok and "e3 rank 1" in done.reason, done


def test_a_register_whose_layout_does_not_fit_its_spec_is_refused_and_changes_nothing():
    import pytest

    from messages.errors import WeightSyncError

    o = ready_v1_spooled()
    bad = Slices(key="abc", rank_bytes=(24, 24), ranks=({"w": ((3, 2), (0, 2))}, {"n": "whole"}))
    before = set(o.engines)
    with pytest.raises(WeightSyncError, match="outside its shape"):
        o.handle(ev.EngineRegistered(Register(engine_id="e9", backend="torch", spec=SPEC, slices=bad)), 5.0)
    assert set(o.engines) == before
    assert Finalize(sync_id="s", version=1, digest="d").digest == "d"


def test_a_finish_that_left_a_rank_without_its_box_is_incomplete_and_names_the_rank():
    import pytest

    from messages.errors import ErrorCode, WeightSyncError
    from messages.schema import Begin, Bucket, Finish, TensorMeta
    from orchestrator.core import Core, Limits

    def fleet():
        o = Core(Limits(min_engines=1))
        _register_sliced(o, "e0")
        o.handle(ev.BeginSync(Begin(sync_id="s1", version=1)), 1.0)
        return o

    def send(o, seq, tensors):
        o.handle(ev.BucketIn(Bucket(sync_id="s1", seq=seq, tensors=tensors, checksum=0), 64), 1.0)
        o.handle(ev.Loaded("e0", "s1", (0, seq)), 1.0)

    n = TensorMeta("n", "float32", (2,), 0, 8)
    w0 = TensorMeta("w", "float32", (4, 2), 64, 16, box=((0, 2), (0, 2)))
    w1 = TensorMeta("w", "float32", (4, 2), 0, 16, box=((2, 2), (0, 2)))
    o = fleet()
    send(o, 0, (n, w0))  # rank 1's box of w never sent
    with pytest.raises(WeightSyncError) as err:
        o.handle(ev.FinishSync(Finish(sync_id="s1", buckets=1)), 1.0)
    assert err.value.code is ErrorCode.INCOMPLETE_SYNC and "e0 rank 1" in err.value.message, err.value
    assert "w[[2, 2], [0, 2]]" in err.value.message and o.state.value == "LOADING_BUCKETS"
    send(o, 1, (w1,))  # the trainer sends it and finishes again: taken
    o.handle(ev.FinishSync(Finish(sync_id="s1", buckets=2)), 1.0)
    assert o.state.value == "FINALIZING"
    o2 = fleet()  # the whole tensor covers every rank's box
    send(o2, 0, (n, TensorMeta("w", "float32", (4, 2), 64, 32)))
    o2.handle(ev.FinishSync(Finish(sync_id="s1", buckets=1)), 1.0)
    assert o2.state.value == "FINALIZING"
