"""The core says when to wake it: `Core.next_wake()` is the first instant at which a tick
acts. For each kind of deadline a scenario puts it first; a tick at the float before the
wake changes nothing, a tick exactly at it fails what is due with its own words. A random
sharded push (two sources) drives its time only through `next_wake`."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from messages.errors import WeightSyncError
from messages.schema import Begin, Bucket, Finalized, Finish, ParamSpec, Register, TensorMeta
from orchestrator.core import Core, Limits, State
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev
from orchestrator.core.clock import Due, deadlines
from tests.unit.test_fsm_recovery import ready_v1_spooled

ENGINES = ("e0", "e1")
NAMES = ("a", "b", "c", "d")  # source k sends NAMES[2k], NAMES[2k + 1]
SPEC = tuple(ParamSpec(name=n, dtype="float32", shape=(4,)) for n in NAMES)
LIMITS = {
    "engine_timeout": 7.0,
    "bucket_timeout": 3.0,
    "sync_timeout": 5.0,
    "finalize_timeout": 4.0,
    "trainer_grace": 2.0,
    "lost_expiry": 6.0,
}


def new(**lim: float) -> Core:
    o = Core(Limits(min_engines=2, **{**LIMITS, **lim}))
    for e in ENGINES:
        o.handle(ev.EngineRegistered(Register(engine_id=e, backend="torch", spec=SPEC)), 0.0)
    return o


def begin(o: Core, at: float, sources: int = 1, source: int = 0, version: int = 1) -> None:
    msg = Begin(sync_id=f"own-{source}", version=version, sources=sources, source=source, seat=source)
    o.handle(ev.BeginSync(msg), at)


def bucket(o: Core, at: float, source: int = 0, seq: int = 0) -> None:
    names = NAMES[2 * source + seq % 2 : 2 * source + seq % 2 + 1]
    metas = tuple(TensorMeta(n, "float32", (4,), 0, 16) for n in names)
    sid = o.sync.sync_id if o.sync is not None else "none"
    msg = Bucket(sync_id=sid, seq=seq, tensors=metas, checksum=0, source=source, seat=source)
    o.handle(ev.BucketIn(msg, 16), at)


def heartbeats(o: Core, at: float) -> None:
    for e in ENGINES:
        o.handle(ev.Heartbeat(e), at)


def _silent(o: Core) -> None:  # no sync: the engines' own deadline
    heartbeats(o, 1.0)


def _bucket(o: Core) -> None:
    begin(o, 1.0)
    bucket(o, 1.5)


def _trainer_silent(o: Core) -> None:
    begin(o, 1.0)


def _trainer_gone(o: Core) -> None:
    begin(o, 1.0)
    o.handle(ev.TrainerGone("own-0", 0), 1.25)


def _finalize(o: Core) -> None:
    begin(o, 1.0)
    metas = tuple(TensorMeta(n, "float32", (4,), 16 * i, 16) for i, n in enumerate(NAMES))
    o.handle(ev.BucketIn(Bucket(sync_id="own-0", seq=0, tensors=metas, checksum=0, seat=0), 64), 1.0)
    for e in ENGINES:
        o.handle(ev.Loaded(e, "own-0", (0, 0)), 1.0)
    o.handle(ev.FinishSync(Finish(sync_id="own-0", buckets=1, seat=0)), 1.5)
    o.handle(ev.EngineFinalized("e0", Finalized(sync_id="own-0", version=1, digest="d")), 1.5)


def _never_began(o: Core) -> None:
    begin(o, 1.0, sources=2)


def _source_quiet(o: Core) -> None:
    begin(o, 1.0, sources=2)
    begin(o, 2.0, sources=2, source=1)
    bucket(o, 2.5, source=1)
    for e in ENGINES:
        o.handle(ev.Loaded(e, "own-0", (1, 0)), 2.5)
    o.handle(ev.FinishSync(Finish(sync_id="own-0", buckets=1, source=1, seat=1)), 2.5)


def _forget(o: Core) -> None:
    o.handle(ev.EngineGone("e1", goodbye=True), 0.5)
    o.handle(ev.Tick(), 0.5)  # LOST at 0.5 (as the service ticks it), forgotten lost_expiry later
    heartbeats(o, 6.0)


# kind, the scenario, the deadline it puts first, what the tick at it says or does
SCENARIOS = [
    (Due.ENGINE_SILENT, _silent, 1.0 + 7.0, "EngineLost"),
    (Due.BUCKET, _bucket, 1.5 + 3.0, "bucket seq 0 not applied within 3.0s by ['e0', 'e1']"),
    (Due.TRAINER_SILENT, _trainer_silent, 1.0 + 5.0, "no trainer message for 5.0s"),
    (Due.TRAINER_GONE, _trainer_gone, 1.25 + 2.0, "the trainer's connection closed 2.0s ago mid-sync"),
    (Due.FINALIZE, _finalize, 1.5 + 4.0, "finalize not reported within 4.0s by ['e1']"),
    (Due.NEVER_BEGAN, _never_began, 1.0 + 5.0, "source(s) [1] of 2 never began within 5.0s"),
    (Due.SOURCE_QUIET, _source_quiet, 1.0 + 5.0, "no message from source(s) [0] for 5.0s"),
    (Due.FORGET, _forget, 0.5 + 6.0, "EngineForgotten"),
]


def _said(res: object) -> str:
    out = []
    for c in getattr(res, "commands", []):
        out.append(type(c).__name__)
        if isinstance(c, cmd.CompleteSync) and c.error is not None:
            out.append(c.error.message)
    return " | ".join(out)


@pytest.mark.parametrize(
    ("kind", "scenario", "bound", "said"), SCENARIOS, ids=[s[0].value for s in SCENARIOS]
)
def test_each_deadline_is_met_exactly_at_the_next_wake_and_not_a_float_before(kind, scenario, bound, said):
    o = new()
    scenario(o)
    wake = o.next_wake()
    first = min(deadlines(o), key=lambda d: d.at)
    assert first.what is kind
    # a "more than N seconds" rule is due at the float after its bound, an "N seconds" one at it
    assert wake == first.at and wake in (bound, math.nextafter(bound, math.inf)), (wake, bound)
    before = copy.deepcopy(o.snapshot())
    res = o.handle(ev.Tick(), math.nextafter(wake, -math.inf))
    assert not res.commands and o.snapshot() == before
    assert o.next_wake() == wake
    res = o.handle(ev.Tick(), wake)
    assert said in _said(res), _said(res)


def test_a_rollback_and_a_lost_engines_catch_up_are_due_at_once():
    o = ready_v1_spooled()
    o.handle(ev.BeginSync(Begin(sync_id="s2", version=2)), 2.0)
    o.handle(
        ev.BucketIn(
            Bucket(sync_id="s2", seq=0, tensors=(TensorMeta("w", "float32", (4,), 0, 16),), checksum=0), 16
        ),
        2.0,
    )
    o.handle(ev.AbortSync("s2", "test"), 2.5)
    assert any(d.what is Due.ROLLBACK for d in deadlines(o)) and o.next_wake() == 2.5
    res = o.handle(ev.Tick(), 2.5)
    assert [type(c) for c in res.commands if isinstance(c, cmd.StartRollback)] == [cmd.StartRollback]


def test_no_deadline_no_wake():
    o = Core(Limits(min_engines=1))
    assert o.next_wake() is None and deadlines(o) == []
    assert not o.handle(ev.Tick(), 1e9).commands


class ShardedPush(RuleBasedStateMachine):
    """Two sources, random orders; the clock moves only to the core's next wake (or the
    float before it): before, nothing changes; at it, something does."""

    def __init__(self) -> None:
        super().__init__()
        self.o = new(engine_timeout=1e5)
        self.now = 1.0
        self.version = 1

    def _run(self, f) -> None:  # type: ignore[no-untyped-def]
        try:
            f()
        except WeightSyncError:
            pass

    def _sid(self) -> str:
        return self.o.sync.sync_id if self.o.sync is not None else "none"

    @rule(source=st.integers(0, 1))
    def do_begin(self, source: int) -> None:
        if self.o.state not in (State.IDLE, State.READY, State.LOADING_BUCKETS):
            return
        if self.o.sync is None:
            self.version += 1
        self._run(lambda: begin(self.o, self.now, sources=2, source=source, version=self.version))

    @rule(source=st.integers(0, 1), seq=st.integers(0, 1))
    def do_bucket(self, source: int, seq: int) -> None:
        self._run(lambda: bucket(self.o, self.now, source, seq))

    @rule(source=st.integers(0, 1), seq=st.integers(0, 1), engine=st.sampled_from(ENGINES))
    def do_loaded(self, source: int, seq: int, engine: str) -> None:
        self._run(lambda: self.o.handle(ev.Loaded(engine, self._sid(), (source, seq)), self.now))

    @rule(source=st.integers(0, 1), n=st.integers(1, 2))
    def do_finish(self, source: int, n: int) -> None:
        msg = Finish(sync_id=self._sid(), buckets=n, source=source, seat=source)
        self._run(lambda: self.o.handle(ev.FinishSync(msg), self.now))

    @rule(source=st.integers(0, 1))
    def do_trainer_gone(self, source: int) -> None:
        self._run(lambda: self.o.handle(ev.TrainerGone(self._sid(), source), self.now))

    @rule(engine=st.sampled_from(ENGINES))
    def do_finalized(self, engine: str) -> None:
        s = self.o.sync
        version = s.version if s is not None else 1
        msg = Finalized(sync_id=self._sid(), version=version, digest="d")
        self._run(lambda: self.o.handle(ev.EngineFinalized(engine, msg), self.now))

    @rule(past=st.booleans())
    def do_tick_at_the_next_wake(self, past: bool) -> None:
        heartbeats(self.o, self.now)
        wake = self.o.next_wake()
        if wake is None:
            t, acts = self.now + 1e6, False
        elif not past:
            if wake <= self.now:
                return
            t, acts = math.nextafter(wake, -math.inf), False
        else:
            t, acts = max(self.now, wake), True
        before = copy.deepcopy(self.o.snapshot())
        res = self.o.handle(ev.Tick(), t)
        changed = bool(res.commands) or self.o.snapshot() != before
        assert changed == acts, (wake, t, [d for d in deadlines(self.o)])
        self.now = t


ShardedPush.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_a_sharded_push_meets_every_deadline_at_the_next_wake = ShardedPush.TestCase
