"""The post-load step (finalize) runs exactly once per sync whatever the order of the
daemon's messages and the applier's reports, and never for a sync aborted before its
finalize: hypothesis drives the engine's `Session` with a model of its applier thread."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engines.session import Session, Submit
from messages import schema
from tests.unit.session_inputs import GROUP, failed, finalized, load

SYNCS = ("s1", "s2")  # two: a message of the other sync supersedes often
step = st.one_of(
    st.tuples(
        st.sampled_from(["load", "stream", "finalize", "abort", "commit"]),
        st.sampled_from(SYNCS),
        st.integers(0, 2),
    ),
    st.tuples(st.sampled_from(["run", "run", "fail"]), st.just(""), st.just(0)),
)


class Applier:
    """The applier thread as a model: runs the engine's jobs in order and counts the
    post-load steps; a failed sync's finalize only releases its maps (as the real one)."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []
        self.failed: set[str] = set()
        self.post_load: dict[str, int] = {}
        self.fail_next = False

    def run_one(self) -> schema.Message | None:
        if not self.jobs:
            return None
        job = self.jobs.pop(0)
        if isinstance(job, schema.Load):
            if self.fail_next:
                self.fail_next = False
                self.failed.add(job.sync_id)
                return failed(job.sync_id)
            return schema.Loaded(sync_id=job.sync_id, seq=job.seq, source=job.source)
        if isinstance(job, schema.Finalize) and job.sync_id not in self.failed:
            self.post_load[job.sync_id] = self.post_load.get(job.sync_id, 0) + 1
            return finalized(job.sync_id, job.version)
        return None


def message(kind: str, sync_id: str, seq: int) -> schema.Message:
    version = SYNCS.index(sync_id) + 1
    return {
        "load": lambda: load(sync_id, seq, version),
        "stream": lambda: schema.OpenStream(sync_id=sync_id, version=version, group=GROUP),
        "finalize": lambda: schema.Finalize(sync_id=sync_id, version=version),
        "abort": lambda: schema.Abort(sync_id=sync_id),
        "commit": lambda: schema.Commit(sync_id=sync_id, version=version),
    }[kind]()


@settings(max_examples=500, deadline=None)
@given(st.lists(step, max_size=40))
@example([("load", "s1", 0), ("abort", "s1", 0), ("finalize", "s1", 0)])
@example([("load", "s1", 0), ("finalize", "s1", 0), ("load", "s2", 0), ("finalize", "s1", 0), ("run", "", 0)])
@example([("load", "s1", 0), ("fail", "", 0), ("finalize", "s1", 0), ("run", "", 0), ("finalize", "s1", 0)])
def test_the_post_load_step_runs_exactly_once_per_sync_whatever_the_order(steps):
    s, applier = Session(), Applier()
    ended: set[str] = set()  # aborted or failed (as the daemon and applier said) before its finalize
    asked: set[str] = set()  # a finalize came while it had not ended
    aborted_running: str | None = None  # aborted while the running sync, and still running

    def take(actions: list[Any]) -> None:
        applier.jobs.extend(a.job for a in actions if isinstance(a, Submit))

    def run(fail: bool) -> None:
        applier.fail_next = fail
        report = applier.run_one()
        if isinstance(report, schema.Failed) and report.sync_id not in asked:
            ended.add(report.sync_id)
        if report is not None:
            s.result(report)

    for kind, sync_id, seq in steps:
        if kind in ("run", "fail"):
            run(kind == "fail")
            continue
        running = s.current.sync_id if s.current is not None else None
        if kind == "abort" and running == sync_id:
            aborted_running = sync_id
        if kind == "abort" and sync_id not in asked:
            ended.add(sync_id)
        out = s.feed(message(kind, sync_id, seq))
        if kind == "finalize":
            if aborted_running == sync_id and running == sync_id:
                assert not [a for a in out if isinstance(a, Submit)], "a post-load step after its abort"
            if sync_id not in ended:
                asked.add(sync_id)
        take(out)
        if s.current is None or s.current.sync_id != aborted_running:
            aborted_running = None
        assert all(n == 1 for n in applier.post_load.values()), applier.post_load
    while applier.jobs:
        run(False)
        take([])
    assert all(n == 1 for n in applier.post_load.values()), applier.post_load
    for sync_id in asked - applier.failed:
        assert applier.post_load.get(sync_id) == 1, (sync_id, steps)
