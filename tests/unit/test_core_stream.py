"""The collective stream in the pure core: a two-phase commit whose inputs (and commands)
do not depend on the bucket count, and that finalizes nothing unless every participant
prepared exactly what the trainer finished with."""

from __future__ import annotations

import pytest

from messages.errors import ErrorCode, WeightSyncError
from messages.replies import BeginReply, decode
from messages.schema import Begin, CollectiveOffer, Finalized, Finish, Prepared, Register
from messages.stream import Chain
from orchestrator.core import Core, Limits, State
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev

ENGINES = ("e0", "e1")
OFFER = CollectiveOffer(host="10.0.0.1", port=2000, session="s1", stream=True)
DIGEST = "d" * 32


def fleet(stream: bool = True) -> Core:
    core = Core(Limits(min_engines=len(ENGINES), bucket_timeout=10.0))
    for e in ENGINES:
        reg = Register(
            engine_id=e,
            backend="torch",
            transports=("inline", "collective"),
            collective_ranks=1,
            collective_backends=("gloo",),
            collective_stream=stream,
        )
        core.handle(ev.EngineRegistered(reg), 0.0)
    return core


def chain_of(buckets: int) -> Chain:
    c = Chain()
    for seq in range(buckets):
        c.add(1000 + seq, 64)
    return c


def run_sync(core: Core, version: int, buckets: int) -> tuple[int, list[cmd.Command]]:
    """One collective sync as the daemon sees it; (inputs fed to the core, commands out)."""
    sid = f"s{version}"
    events: list[ev.Event] = [
        ev.BeginSync(Begin(sync_id=sid, version=version, transport="collective", offer=OFFER))
    ]
    c = chain_of(buckets)  # the engines and the trainer chain the same checksums
    events += [
        ev.EnginePrepared(
            e, Prepared(sync_id=sid, buckets=buckets, nbytes=c.nbytes, chain=c.value, digest=DIGEST)
        )
        for e in ENGINES
    ]
    events.append(ev.FinishSync(Finish(sync_id=sid, buckets=buckets, digest=DIGEST, chain=c.value)))
    events += [
        ev.EngineFinalized(e, Finalized(sync_id=sid, version=version, digest=DIGEST, finalize_count=version))
        for e in ENGINES
    ]
    out: list[cmd.Command] = []
    for i, e in enumerate(events):
        out += core.handle(e, 1.0 + i).commands
    return len(events), out


def test_daemon_inputs_and_commands_do_not_grow_with_the_bucket_count():
    core = fleet()
    seen = []
    for version, buckets in ((1, 2), (2, 2000), (3, 200_000)):
        inputs, out = run_sync(core, version, buckets)
        assert core.state is State.READY and core.last_ready_version == version
        assert core.last_sync is not None and core.last_sync["buckets"] == buckets
        kinds = sorted(type(c).__name__ for c in out if not isinstance(c, cmd.Journal))
        seen.append((inputs, kinds))
    assert seen[0] == seen[1] == seen[2]
    (inputs, kinds) = seen[0]
    assert inputs == 2 + 2 * len(ENGINES)  # begin, finish; prepared and finalized per engine
    assert kinds.count("OpenStreams") == 1 and kinds.count("SendFinalize") == len(ENGINES)
    assert "ForwardBucket" not in kinds and "AckBucket" not in kinds


def test_without_every_engine_able_the_sync_announces_each_bucket():
    core = fleet(stream=False)
    res = core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, transport="collective", offer=OFFER)), 1.0)
    started = decode(res.reply or {}, BeginReply)
    assert not started.stream and started.transport == "collective"
    assert not [c for c in res.commands if isinstance(c, cmd.OpenStreams)]


def begun(core: Core, buckets: int = 5) -> Chain:
    core.handle(ev.BeginSync(Begin(sync_id="s1", version=1, transport="collective", offer=OFFER)), 1.0)
    return chain_of(buckets)


def prepared(core: Core, engine: str, c: Chain, *, buckets: int | None = None, digest: str = DIGEST):
    msg = Prepared(
        sync_id="s1",
        buckets=c.buckets if buckets is None else buckets,
        nbytes=c.nbytes,
        chain=c.value,
        digest=digest,
    )
    return core.handle(ev.EnginePrepared(engine, msg), 2.0)


def finish(core: Core, c: Chain, chain: int | None = None):
    msg = Finish(sync_id="s1", buckets=c.buckets, digest=DIGEST, chain=c.value if chain is None else chain)
    return core.handle(ev.FinishSync(msg), 3.0)


@pytest.mark.parametrize(
    "case",
    ["wrong_digest", "wrong_chain", "missing_bucket", "trainer_chain_differs"],
)
def test_a_prepared_that_differs_fails_the_sync_named_with_nothing_finalized(case):
    core = fleet()
    c = begun(core)
    out = prepared(core, "e0", c).commands
    if case == "wrong_digest":
        out += prepared(core, "e1", c, digest="e" * 32).commands
    elif case == "wrong_chain":
        out += prepared(core, "e1", chain_of(4)).commands
    elif case == "missing_bucket":
        out += prepared(core, "e1", c, buckets=4).commands
    else:
        out += prepared(core, "e1", c).commands
    assert core.state is State.LOADING_BUCKETS  # prepared, but the trainer has not finished
    res = finish(core, c, chain=c.value ^ 1 if case == "trainer_chain_differs" else None)
    # the finish is answered once, by the failed sync's CompleteSync (no success body now)
    assert res.later and res.reply is None
    out += res.commands
    assert core.state is State.IDLE and core.dirty
    assert not [x for x in out if isinstance(x, cmd.SendFinalize)], "nothing may be finalized"
    (done,) = [x for x in out if isinstance(x, cmd.CompleteSync)]
    assert done.error is not None and done.error.code is ErrorCode.ENGINE_FAILED
    assert ("e1" if case != "trainer_chain_differs" else "e0") in done.error.message
    assert [x for x in out if isinstance(x, cmd.SendAbort)], "the engines drop the stream"


def test_an_engine_that_never_prepares_times_out_named_after_the_finish():
    core = fleet()
    c = begun(core)
    prepared(core, "e0", c)
    finish(core, c)
    assert core.state is State.LOADING_BUCKETS
    for e in ENGINES:  # both keep heartbeating
        core.handle(ev.Heartbeat(e), 12.0)
    res = core.handle(ev.Tick(), 14.0)
    (done,) = [x for x in res.commands if isinstance(x, cmd.CompleteSync)]
    assert done.error is not None and done.error.code is ErrorCode.TIMEOUT and "e1" in done.error.message
    assert not [x for x in res.commands if isinstance(x, cmd.SendFinalize)]


def test_a_long_stream_is_not_cut_by_the_sync_timeout_before_the_finish():
    core = Core(Limits(min_engines=2, sync_timeout=5.0, engine_timeout=1000.0))
    for e in ENGINES:
        core.handle(
            ev.EngineRegistered(
                Register(
                    engine_id=e,
                    backend="torch",
                    collective_ranks=1,
                    collective_backends=("gloo",),
                    collective_stream=True,
                )
            ),
            0.0,
        )
    begun(core)
    core.handle(ev.Tick(), 60.0)
    assert core.state is State.LOADING_BUCKETS  # the engines' group deadline bounds a stall


def test_finish_without_a_chain_is_refused_and_changes_nothing():
    core = fleet()
    c = begun(core)
    with pytest.raises(WeightSyncError) as info:
        core.handle(ev.FinishSync(Finish(sync_id="s1", buckets=c.buckets)), 3.0)
    assert info.value.code is ErrorCode.BAD_MESSAGE and "chain" in info.value.message
    assert core.state is State.LOADING_BUCKETS and core.sync is not None and not core.sync.finished
