"""The `served` notice, as pure logic: the core tells an engine that hands versions to
readers (`register.served_notice`) only in the batch that makes the version READY, after
that READY's journal row (the service persists first), never for a sync that failed; a
commit-phase timeout names the labelling engines it waited for; the holding engine offers
exactly what it was told is served and withdraws on begin and abort."""

from __future__ import annotations

import threading

import pytest
import torch

from engines.holding import HoldingEngine
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Begin, Committed, ParamSpec, Register
from orchestrator.core import Core, Limits, State
from orchestrator.core import commands as fsm
from orchestrator.core import events as ev
from tests.unit.test_fsm import ack, bucket, cmds, finalized, finish

FLEET = (
    Register(engine_id="e0", backend="torch"),
    Register(engine_id="h1", backend="holding", served_notice=True),
    Register(engine_id="v2", backend="vllm", labels=True),
)


def fleet() -> Core:
    o = Core(Limits(min_engines=3, finalize_timeout=5.0))
    for r in FLEET:
        o.handle(ev.EngineRegistered(r), 0.0)
    return o


def all_finalized(o: Core, version: int) -> list:
    """Sync `s{version}` to the point where every participant finalized; each input's result."""
    o.handle(ev.BeginSync(Begin(sync_id=f"s{version}", version=version)), 1.0)
    out = [bucket(o, 0)]
    ack(o, 0, engines=("e0", "h1", "v2"))
    out.append(finish(o, 1))
    out += [finalized(o, e) for e in ("e0", "h1", "v2")]
    return out


def test_a_holder_is_told_served_after_the_ready_row_and_only_then():
    o = fleet()
    before = all_finalized(o, 1)
    assert not [c for r in before for c in cmds(r, fsm.SendServed)]  # finalized everywhere is not served
    assert o.state == State.FINALIZING  # the labelling engine's commit is pending
    res = o.handle(ev.EngineCommitted("v2", Committed(sync_id="s1", version=1, label="1")), 1.5)
    assert o.state == State.READY
    kinds = [type(c) for c in res.commands]
    ready_row = next(
        i for i, c in enumerate(res.commands) if isinstance(c, fsm.Journal) and c.data.get("to") == "READY"
    )
    assert cmds(res, fsm.SendServed) == [fsm.SendServed("h1", "s1", 1, "d")]  # the holder only
    assert ready_row < kinds.index(fsm.SendServed)
    # it registers again holding the served version (the daemon restarted, or it
    # reconnected): it is told again; one holding something else is not
    again = o.handle(
        ev.EngineRegistered(
            Register(engine_id="h1", backend="holding", served_notice=True, version=1, digest="d")
        ),
        2.0,
    )
    assert cmds(again, fsm.SendServed) == [fsm.SendServed("h1", "", 1, "d")]
    other = o.handle(
        ev.EngineRegistered(
            Register(engine_id="h1", backend="holding", served_notice=True, version=1, digest="x")
        ),
        2.0,
    )
    assert cmds(other, fsm.SendServed) == []


def test_a_commit_phase_timeout_names_the_labelling_engines_and_serves_nothing():
    o = fleet()
    out = all_finalized(o, 1)
    res = o.handle(ev.Tick(), 1.0 + 5.0 + 0.5)  # past --finalize-timeout, v2 never labelled
    out.append(res)
    assert o.state == State.IDLE and o.dirty
    err = cmds(res, fsm.CompleteSync)[0].error
    assert err is not None and err.code == ErrorCode.TIMEOUT
    assert err.details["engine_ids"] == ["v2"] and "['v2']" in err.message and "commit" in err.message
    assert not [c for r in out for c in cmds(r, fsm.SendServed)]
    assert "h1" in cmds(res, fsm.SendAbort)[0].engine_ids  # the holder withdraws what it loaded


SPEC = [ParamSpec(name="w", dtype="float32", shape=(4,))]


def loaded(engine: HoldingEngine, version: int, value: float) -> str:
    engine.begin(f"s{version}", version)
    engine.load([("w", torch.full((4,), value))])
    return engine.finalize(f"s{version}")


def test_the_holding_engine_offers_only_the_served_version_and_digest_it_holds():
    h = HoldingEngine("model", SPEC, timeout=5.0)
    d1 = loaded(h, 1, 1.0)
    assert not h.serve(1, "another digest") and h.served is None
    assert not h.serve(2, d1) and h.served is None
    assert h.serve(1, d1) and h.served == 1
    with h.hold(1, None, 1.0) as v:
        assert v == 1 and torch.equal(h.params["w"], torch.full((4,), 1.0))
    h.begin("s2", 2)  # the buffers change: version 1 is withdrawn
    assert h.served is None and not h.serve(1, d1)


def test_an_aborted_sync_refuses_its_readers_at_once_and_offers_nothing():
    h = HoldingEngine("model", SPEC, timeout=5.0)
    h.serve(1, loaded(h, 1, 1.0))
    d2 = loaded(h, 2, 2.0)  # finalized here, not yet served by the daemon
    result: dict[str, object] = {}

    def reader() -> None:
        try:
            with h.hold(2, None, 30.0):
                result["got"] = True
        except WeightSyncError as err:
            result["code"] = err.code

    t = threading.Thread(target=reader)
    t.start()
    h.abort()  # the sync failed in its commit phase
    t.join(10)
    assert not t.is_alive() and result == {"code": ErrorCode.ABORTED}
    assert not h.serve(2, d2) and h.served is None  # a late notice releases nothing
    with pytest.raises(WeightSyncError) as err:
        with h.hold(2, None, 30.0):
            pass
    assert err.value.code == ErrorCode.ABORTED
    h.begin("s3", 2)  # the version is pushed again: its readers wait for it again
    assert h.aborted is None
